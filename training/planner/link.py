"""The link between two ranks of a job on this machine, measured by a ping-pong of two
processes joined as two containers' ranks are (training.probes.pingpong)."""
import math
import os
import statistics
import subprocess
import sys

from training import probes
from training.perf.model import Link, PlanError


def run_probe(module, args, what, timeout, advice="; give the link with --bandwidth"):
    """Rank 0's result of `module` (training.probes) on two joined ranks; PlanError if it
    fails, ending with `advice` (the link's probe: the link can be given instead)."""
    try:
        return probes.run(module, 2, args, timeout=timeout)
    except probes.ProbeError as e:
        raise PlanError(f"the MPI {what} failed ({e}){advice}") from None


def _pingpong(sizes, trials, timeout, busy=0, polite=False, duty=1.0, shm=None):
    """{size: one-way seconds} of a ping-pong between two joined ranks (measure_link), beside
    `busy` processes each busy `duty` of the time (training.probes.hog)."""
    args = {"sizes": [list(s) for s in sizes], "trials": int(trials), "polite": bool(polite),
            "loaded": busy > 0, "work": 1e-3 if busy else 0.0, "shm": shm}
    hogs = [subprocess.Popen([sys.executable, "-m", "training.probes.hog", repr(float(duty)), str(os.getpid())],
                             env=probes.environment(), start_new_session=True)     # as a rank's container is
            for _ in range(busy)]
    try:
        out = run_probe("training.probes.pingpong", args, "ping-pong", timeout)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return {(k if k == "shm" else int(k)): v for k, v in out.items()}


def measure_link(small=8, large=4 << 20, pool=16, trials=8, timeout=120, busy=0, polite=False, duty=1.0,
                 shared=False, shared_bytes=16 << 20):
    """The link between two ranks of a job on this machine.

    Two processes join one world exactly as two containers of the local engine do
    (MPI singletons through launcher.world, so over MPICH's network module, not shared
    memory), and time a ping-pong: one-way time (half a round trip) of `small` and
    `large` messages, the fastest of `trials` trials (the link's capacity: a busy CPU
    only ever slows a trial down): α = t(small), β = (large − small) / (t(large) − t(small)).
    The large messages cycle through `pool` buffers, so that, like a step's activations
    and gradients, they are not in the cache when they are sent (on one machine a cached
    4 MiB ping-pong runs ~4x faster than a cold one).

    busy > 0 (the job has more ranks on this machine than it has cores): α is measured
    again while `busy` other processes stand for the ranks beyond the cores, each busy
    `duty` of the time (their vcores: a 0.5-vcore rank computes at most half the time),
    each side computing 1 ms between its messages and the second one waiting politely if
    `polite` (as a throttled rank does); the median trial counts. That α is what one
    synchronisation costs when the scheduler must first give a waiting rank a CPU back
    (measured here with fully busy processes: ~0.6 ms polite, ~1.8 ms spinning, instead
    of ~2 us unloaded); β stays the capacity. The sharing of the cores itself (how fast
    each rank computes) is quota_sim's.

    shared (every rank of the job on this host): also the algorithm bandwidth of the two
    ranks' shared-memory all-reduce of `shared_bytes` (training.collectives.shm), the
    link's shared_Bps, which the all-reduce's cost model then uses for its buckets.
    """
    t = _pingpong([(small, 200, 1), (large, pool, pool)], trials, timeout,
                  shm=[shared_bytes, 10] if shared else None)
    alpha = t[small]
    beta = (large - small) / max(t[large] - t[small], 1e-12)
    shm_s = t.get("shm")
    shared_Bps = shared_bytes / shm_s if shm_s else None
    if not busy:
        return Link(alpha, beta, "measured: ping-pong of 2 joined ranks on this machine", shared_Bps=shared_Bps)
    loaded = _pingpong([(small, 100, 1)], trials, timeout, busy, polite, duty)[small]
    return Link(max(alpha, loaded), beta,
                f"measured: ping-pong of 2 joined ranks on this machine; latency with {busy} "
                f"process{'es' if busy > 1 else ''} {100 * duty:.0f}% busy{', polite' if polite else ''}",
                idle_latency_s=alpha, shared_Bps=shared_Bps)


def on_one_host(job):
    """Whether every rank of `job` runs on this host, able to share memory: the local
    engine without emulated nodes."""
    return job.backend == "local" and job.network.nodes <= 1


def local_load(job):
    """{busy, polite, duty} for measure_link: how many more ranks than cores this machine
    runs for the job on the local engine, whether a throttled rank waits politely, and how
    busy those extra ranks keep a CPU (their vcores, the last ranks', at most 1 each)."""
    ranks = [r for g in job.groups for r in [g] * g.instances]
    busy = max(0, len(ranks) - (os.cpu_count() or 1)) if job.backend == "local" else 0
    extra = ranks[len(ranks) - busy:] if busy else []
    duty = statistics.fmean(min(1.0, g.vcores) for g in extra) if extra else 1.0
    return {"busy": busy, "polite": any(g.vcores < max(1, math.ceil(g.vcores)) for g in ranks), "duty": duty}

