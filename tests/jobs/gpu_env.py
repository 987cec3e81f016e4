"""run.function `gpu_env:main`: rank 0 reports what every rank sees of the GPUs
(CUDA_VISIBLE_DEVICES, and with REPORT_CUDA=1 the devices CUDA itself finds), torch's
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and GROUP_WORLD_SIZE, and when it
started; every rank holds on for HOLD_S seconds."""
import os
import time


def cuda_devices():
    """The names of the CUDA devices this process can use (torch is imported only here)."""
    import torch
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def main(ctx):
    started = time.time()
    visible = ctx.comm.gather(os.environ.get("CUDA_VISIBLE_DEVICES"), root=0)
    cuda = ctx.comm.gather(cuda_devices() if os.environ.get("REPORT_CUDA") else None, root=0)
    local = ctx.comm.gather([os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                      "GROUP_WORLD_SIZE")], root=0)
    time.sleep(float(os.environ.get("HOLD_S", "0")))
    ctx.comm.Barrier()
    ctx.final(visible=visible, cuda=cuda, local=local, started=started)
