"""Every strategy's own CPU per step, on two joined ranks (training.planner.cpu.measure_strategy_cpu).

Each strategy of `strategies` runs for real (the registry's class, a RunContext.offline
of a job of one 1-vcore rank per process, one thread each, the batch split equally, the
second rank waiting politely as a throttled one does, a conv-MP split of equal weights
over `layers`). After `warmup` steps (default 3), for each of `steps` steps: its CPU time and what
training.cputime counted in it; the strategy says which part was its own
(Strategy.own_cpu_s). Result: {strategy: [rank 0's median, rank 1's median]} seconds.
A strategy that fails (one that cannot run the model) ends the probe at once with the
line `FAILED <strategy>: <error>` on stderr (the peer would wait for it in a collective).
"""
import os
import statistics
import sys
import time

import torch

import conf
from launcher.world import join_local
from training import collectives, cputime, strategies
from training.context import RunContext
from training.models import build_model
from training.probes import FAILED, arguments, finish, report
from training.runner import make_optimizer_factory


def job_for(name, a, n):
    block = {"name": name, "split": [1.0] * n, "layers": a["layers"]} if name == "conv_model_parallel" else name
    return conf.offline_job([1.0] * n, name="probe", strategy=block, model=a["model"],
                            model_options=a["options"], batch_size=a["batch"])


def main():
    a = arguments()
    comm, rank, n = join_local()
    torch.set_num_threads(1)
    collectives.set_polite(rank > 0)            # the second rank waits as a throttled one does
    collectives.doorbells(comm)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a["batch"], *a["shape"], generator=g)
    y = torch.randint(0, a["classes"], (a["batch"],), generator=g)
    own = {}
    for name in a["strategies"]:
        try:
            own[name] = _own_cpu(name, a, comm, n, x, y)
        except Exception as e:  # noqa: BLE001 - the peer waits in a collective: said, and ended at once
            print(f"{FAILED}{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  file=sys.stderr, flush=True)
            os._exit(1)
    every = comm.gather(own, root=0)
    report(rank, {k: [e[k] for e in every] for k in own} if rank == 0 else None)
    finish(comm)


def _own_cpu(name, a, comm, n, x, y):
    """The median over a["steps"] steps of strategy `name`'s own CPU per step on this rank."""
    job = job_for(name, a, n)
    torch.manual_seed(0)
    model = build_model(a["model"], tuple(a["shape"]), a["classes"], a["options"])
    s = strategies.get(name)(RunContext.offline(comm, job, "probe"), job.training)
    s.setup(model, make_optimizer_factory(job.training))
    lo, hi = s.batch_slice(a["batch"])
    xs, ys = (x[lo:hi], y[lo:hi]) if hi > lo else (None, None)
    for _ in range(a.get("warmup", 3)):
        s.train_step(xs, ys)
    comm.Barrier()
    steps = []
    cputime.enable()
    for _ in range(a["steps"]):
        cputime.reset()
        c0 = time.process_time()
        s.train_step(xs, ys)
        steps.append(s.own_cpu_s(time.process_time() - c0, cputime.seconds()))
    cputime.enable(False)
    s.close()
    comm.Barrier()
    return statistics.median(steps)


if __name__ == "__main__":
    main()
