"""conf/examples/hello.yaml: every rank all-reduces a tensor and reports who it is."""
import logging
import time

import torch

log = logging.getLogger(__name__)


def cpu_rate(seconds=1.0):
    """CPU seconds this process gets per wall second when it spins: ~vcores under a quota."""
    w0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - w0 < seconds:
        sum(range(1000))
    return (time.process_time() - c0) / (time.perf_counter() - w0)


def cpu_quota():
    """The CPU quota of this process's cgroup (v1) in CPUs, or None if it has none."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if ":cpu:" in line or ":cpu," in line)
        base = f"/sys/fs/cgroup/cpu{path}"
        quota = int(open(f"{base}/cpu.cfs_quota_us").read())
        period = int(open(f"{base}/cpu.cfs_period_us").read())
    except (OSError, StopIteration, ValueError):
        return None
    return None if quota < 0 else quota / period


def main(ctx):
    from mpi4py import MPI
    t = torch.full((4,), float(ctx.rank + 1))
    out = torch.empty_like(t)
    ctx.comm.Allreduce(t.numpy(), out.numpy(), op=MPI.SUM)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    me = ctx.me
    log.info("hello from rank %d of %d: group=%s instance=%d vcores=%s threads=%d allreduce=%s",
             ctx.rank, ctx.world_size, me.group, me.instance, me.vcores, torch.get_num_threads(),
             out.tolist())
    ctx.comm.Barrier()
    rate = cpu_rate()   # all ranks spin at once, as they would train
    reports = ctx.comm.gather({"rank": ctx.rank, "group": me.group, "allreduce": out.tolist(),
                               "threads": torch.get_num_threads(), "cpu": round(rate, 2),
                               "quota": cpu_quota()}, root=0)
    ctx.report(step=1, allreduce=out[0].item())
    if ctx.rank == 0:
        ok = all(r["allreduce"] == [expected] * 4 for r in reports)
        ctx.final(world_size=ctx.world_size, allreduce=out[0].item(), expected=expected, ok=ok,
                  groups=",".join(r["group"] for r in reports),
                  cpu=",".join(str(r["cpu"]) for r in reports),
                  quota=",".join(str(r["quota"]) for r in reports))
        if not ok:
            raise RuntimeError(f"all-reduce gave {reports}, expected {expected}")
