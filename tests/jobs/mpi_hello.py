"""A job script needing nothing but yarnapp's own dependencies (no torch): every rank
all-reduces its rank + 1 over the world's communicator; rank 0 reports where it ran from."""
import sys

from mpi4py import MPI

import yarnapp
from training.context import current

ctx = current()
total = ctx.comm.allreduce(ctx.rank + 1, op=MPI.SUM)
print(f"rank {ctx.rank} of {ctx.world_size}: total {total}; python {sys.executable}; yarnapp {yarnapp.__file__}")
ctx.final(world_size=ctx.world_size, total=total, python=sys.executable, yarnapp=yarnapp.__file__)
