"""run.function `slow_join:main`: every rank but 0 takes JOIN_DELAY seconds to import this
module, so rank 0 waits that long for its first joiner (a window for a foreign process
to knock). Then the world all-reduces and rank 0 reports the result."""
import os
import time

if os.environ.get("YARNAPP_RANK") != "0":
    time.sleep(float(os.environ.get("JOIN_DELAY", "10")))


def main(ctx):
    import numpy as np
    total = ctx.comm.allreduce(np.array([ctx.rank + 1.0]))
    ctx.final(world=ctx.world_size, total=float(total[0]))
