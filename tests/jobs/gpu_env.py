"""run.function `gpu_env:main`: rank 0 reports what every rank sees of the GPUs
(CUDA_VISIBLE_DEVICES) and when it started; every rank holds on for HOLD_S seconds."""
import os
import time


def main(ctx):
    started = time.time()
    visible = ctx.comm.gather(os.environ.get("CUDA_VISIBLE_DEVICES"), root=0)
    time.sleep(float(os.environ.get("HOLD_S", "0")))
    ctx.comm.Barrier()
    ctx.final(visible=visible, started=started)
