"""A job script that logs a falling `train/loss` (the runner's tag) to TensorBoard every 0.2 s.

    args: [STEPS]   stop after STEPS steps (default: run for about 5 minutes or until killed)
"""
import sys
import time

from training.context import current
from training.tensorboard import TBLogger

ctx = current()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1500
tb = TBLogger(ctx.logdir, ctx.app_id, sync_every=ctx.job.tensorboard.sync_every) if ctx.rank == 0 else None
for step in range(steps):
    if tb:
        tb.scalars(step, {"train/loss": 2.0 / (step + 1)})
    ctx.report(step=step)
    time.sleep(0.2)
if tb:
    tb.close()
