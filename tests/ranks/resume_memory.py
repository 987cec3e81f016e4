"""The allreduce strategy resuming from a checkpoint on 2 ranks: each rank's peak memory
growth while it loads, over the checkpoint's size, and whether the model and optimizer came
back bit for bit. Args JSON: {"dir": a directory for the checkpoint file}."""
import json
import os
import resource
import sys

import pyarrow.fs as pafs
import torch
import torch.nn as nn

import conf
from launcher.world import join_local
from training import fsutil, strategies
from training.context import RunContext
from training.probes import finish, report

args = json.loads(sys.argv[1])
comm, rank, size = join_local()
spec = conf.offline_job([1.0] * size, strategy="allreduce", batch_size=8).training
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), *[nn.Linear(1024, 1024) for _ in range(12)], nn.Linear(1024, 10))   # 50 MB
s = strategies.get("allreduce")(RunContext.offline(comm, conf.offline_job([1.0] * size)), spec)
s.setup(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
x, y = torch.randn(8, 1024), torch.randint(0, 10, (8,))
lo, hi = s.batch_slice(8)
s.train_step(x[lo:hi], y[lo:hi])
path = os.path.join(args["dir"], f"rank-{rank:05d}.pt")
torch.save(s.state_dict(), path)
want = [p.detach().clone() for p in s.model.parameters()]
momentum = [s.optimizer.state[p]["momentum_buffer"].clone() for p in s.model.parameters()]
with torch.no_grad():                           # what the load must replace, on every rank (memory freed
    for p in s.model.parameters():              # here may come back to torch.empty: NaN, not the values)
        p.zero_()
        s.optimizer.state[p]["momentum_buffer"].fill_(float("nan"))
s.optimizer.state.clear()
comm.Barrier()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
s.load_state_dict(fsutil.torch_load_file(pafs.LocalFileSystem(), path))
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
same = all(torch.equal(a, b) for a, b in zip(want, s.model.parameters())) and \
    all(torch.equal(a, s.optimizer.state[p]["momentum_buffer"]) for a, p in zip(momentum, s.model.parameters()))
s.train_step(x[lo:hi], y[lo:hi])                # and it trains on
size0 = os.path.getsize(os.path.join(args["dir"], "rank-00000.pt"))
out = comm.gather({"grew": grew / size0, "same": same}, root=0)
s.close()
report(rank, out)
finish(comm)
