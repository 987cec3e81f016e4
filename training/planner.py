"""Predicted step time and speedup of every strategy for a job (seed 4's model, seed 1's bound).

What is measured (on this machine, in this process, unless given):
    per layer l of the job's model at the job's batch B, forward + backward seconds
    t_l (mean of repeated runs; where they add up to more than the whole model's
    time they are scaled down to it, keeping their proportions), the whole model's
    forward + backward with the loss t(B) and t(B/4) (an affine fit
    t(b) = a + (t(B) − a) b / B for row counts not measured), and one optimizer step o
    over all |W| parameter bytes, for each thread count the groups use (a rank runs
    k = ceil(vcores) threads). Then what the ranks will really run: t(n_r) at every
    rank's row count, and each conv share (c kernels of layer l) as a conv of c kernels
    on the layer's input, because neither is proportional (here 16 rows took 2x 8 rows'
    time, and 21 of conv1's 32 kernels 5x 11 of them). A rank that sleeps while it waits
    (a throttled rank; a conv-MP worker) is timed after 20 ms pauses (`idle_profile`:
    ~20% slower than back to back). On the local engine the ranks share this machine, so
    all of this is timed beside min(n, cores) − 1 co-runners training the same model
    (`co_runners`). A container of v vcores running k threads gets the quota q = v/k of
    k cores (see "CPU quotas" below);
    the link: one-way time of m bytes t(m) = α + m/β, fitted to an MPI ping-pong between
    two processes joined as two containers' ranks are (α from 8-byte messages, β from
    cache-cold 4 MiB ones), or given. Where the job has more ranks on this machine than
    cores, α is measured beside processes standing for the extra ranks, each as busy as
    their vcores (`measure_link(busy=..., duty=...)`): a waiting rank must then first get
    a CPU back, 0.1-0.2 ms per synchronisation beside a 0.5-vcore one instead of ~2 us;
    what waiting costs a rank that waits politely (throttled ranks, conv-MP workers):
    a + r·wait + b·bytes received seconds of CPU per wait (`measure_wait_cpu`: ~0.3 ms,
    ~0.1 and ~0.2 ms per MB here: MPI copies a message inside the wait), and
    what each strategy spends per step on rank 0 and on the others beyond the model, its
    conv shares, the optimizer and the waits (gradient hooks, bucket copies, the
    server's sums, the conv-MP protocol's Python and autograd, MPI calls:
    `measure_strategy_cpu`, every strategy run for real on two joined ranks; for seed_cnn
    here ~0.5-1 ms a step data-parallel, ~3 ms a conv-MP worker). Both matter most where
    CPU is scarce: on a 0.5-vcore rank they come out of its quota.

Notation: n ranks (rank 0 first), g_r = t_r(n_r) + u_r the compute of rank r's share of
n_r rows (shares: equal | vcores | speed | list, split as the strategies split them) plus
the strategy's own CPU u_r, g = max_r g_r (the slowest share), o_r rank r's optimizer
step, c = α + |W|/β.

    ring all-reduce  T = g + max_r o_r + 2(n−1)/n·|W|/β + 2(n−1)α          (+ 2⌈log2 n⌉α
                     for the two small all-reduces of rows and loss in every step)
    central PS       seed 4: (m+1)c + g ≤ T ≤ 2mc + g for m workers talking to the server;
                     rank 0 is server and worker, so m = n−1; our server receives the m
                     gradients one after another and then sends m copies of W, with no
                     overlap, so T = g + 2(n−1)c + o_0 (the upper bound)   (+ 2⌈log2 n⌉α)
    sharded PS       T = g + 2(n−1)/n·|W|/β + 2α + max_r o_r / n            (+ 2⌈log2 n⌉α)
    conv-layer MP    (rank 0 the master; distributed convs l with C_l kernels split c_r,l,
                     by default proportional to the speed 1/t_r,l, `proportional_split`)
                     T = (t_0(B) − Σ_l t_0,l) + Σ_l [max_r (c_r,l/C_l) t_r,l + comm_l]
                         + o_0 (1 − Σ_l (|W_l|/|W|)(1 − c_0,l/C_l)) + (2L + 2)⌈log2 n⌉α
                     comm_l = bcast(|X_l|) + 2(1 − c_0,l/C_l)|Y_l|/β + 5⌈log2 n⌉α
                              [+ reduce(|X_l|) where an earlier layer needs dX]
                     bcast(v) = reduce(v) = min(⌈log2 n⌉(α + v/β),
                                                2(n−1)/n·v/β + (⌈log2 n⌉ + n − 1)α)
                     (binomial tree, or scatter + all-gather, whichever MPI would pick)
    CPU quotas       a rank with q < 1 computes at q of its speed on average (its
    and shared cores times / q), but not evenly: CFS runs it at full speed until it has
                     spent q·P of CPU in the period P, then stops it; quota unused at a
                     period's end is lost, and its waits cost CPU (a polite wait,
                     training.collectives.set_polite, burns ~10% of one: measure_wait_cpu).
                     On the local engine the ranks also share this machine's cores. So
                     each strategy's step (its phases, each ended by a synchronisation:
                     compute | exchange | optimizer for the data-parallel ones, every
                     conv layer | the rest | the optimizer for conv-MP) is played out
                     under the ranks' quotas and cores (training.quota_sim); without
                     either it is the formula above ("formula_s" in the plan)
    the bound        S ≤ 1 / ((1 − f) + f/k)  (seed 1), f = Σ_l t_0,l / (t_0(B) + o_0)
                     the distributed convs' share of one device's step; k = Σ_r s_r / s_0
                     with s_r = 1/t_r(B) (k = n for equal devices)
    speedup          S = T_1 / T,  T_1 = t_0(B) + o_0 (rank 0's container alone, whole batch)

Simulated clusters (more machines, other bandwidths, GPU/CPU mixes as in the seed
thesis) use the same formulas with devices of a given speed factor: a machine like
rank 0's container (speed 1) and, with `gpu_speed`, a GPU = a device whose times are
rank 0's divided by gpu_speed, as the master of n−1 such CPUs.

The plan is a JSON-ready dict (`plan_job`); `format_table` and `write_png` present it.
Not modelled: overlap of the ring's buckets with backward (the ring's time is added
after compute), a server's own CPU growing with its workers (it is measured with one),
other load on the machine.
"""
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import select
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from conf.errors import YarnappError
from training import quota_sim
from training.calibrate import num_threads, proportional_split
from training.model_parallel import why_not_distributable
from training.models import build_model
from training.strategies.allreduce import split_rows

log = logging.getLogger(__name__)

STRATEGIES = ("allreduce", "ps_central", "ps_sharded", "conv_model_parallel")
DEFAULT_LATENCY_S = 50e-6          # a given --bandwidth without --latency: a LAN's one-way delay
DEFAULT_INPUT = {"digits_cnn": (1, 8, 8)}   # models whose data could not be read
FALLBACK_INPUT = (3, 32, 32)
QUICK_MIN_TIME = 0.02              # --quick: seconds each timed item runs (default 0.1)


class PlanError(YarnappError, ValueError):
    """A plan that cannot be made. str() is one line saying what to give instead."""


# ----------------------------------------------------------------------------------------
# Seed formulas (pure; c = communication of one |W| transfer, g = gradient compute)
# ----------------------------------------------------------------------------------------

def ring_allreduce_s(n, c, g):
    """Ring all-reduce step: g + 2(n−1)/n · c."""
    return g + 2 * (n - 1) / n * c


def central_ps_s(n, c, g):
    """Seed 4's central parameter server with n workers: (best, worst) = ((n+1)c + g, 2nc + g)."""
    return (n + 1) * c + g, 2 * n * c + g


def sharded_ps_s(n, c, g):
    """Seed 4's sharded ("distributed") server, a shard on every worker: 2c(n−1)/n + g."""
    return 2 * c * (n - 1) / n + g


def amdahl_bound(f, k):
    """Seed 1's bound on the speedup of distributing a share f of the work over k devices:
    S ≤ 1 / ((1 − f) + f / k)."""
    return 1.0 / ((1.0 - f) + f / k)


def proportional_s(seconds):
    """Time of work split in proportion to speed over devices that take `seconds` each for
    all of it: 1 / Σ_r (1 / t_r)  (every device then finishes at the same time)."""
    return 1.0 / sum(1.0 / t for t in seconds)


def _log2(n):
    return math.ceil(math.log2(n)) if n > 1 else 0


# ----------------------------------------------------------------------------------------
# The link
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Link:
    """One-way time of m bytes: latency_s + m / bandwidth_Bps."""
    latency_s: float
    bandwidth_Bps: float          # bytes per second
    source: str = "given"
    idle_latency_s: Optional[float] = None   # where latency_s was measured with the CPUs busy

    @property
    def bandwidth_bps(self):
        return 8.0 * self.bandwidth_Bps

    def between_machines(self):
        """The link as separate machines would see it: without this machine's CPU contention
        (simulated clusters put every rank on a machine of its own)."""
        if self.idle_latency_s is None:
            return self
        return Link(self.idle_latency_s, self.bandwidth_Bps, self.source + "; idle latency")

    def seconds(self, nbytes):
        return self.latency_s + nbytes / self.bandwidth_Bps

    def as_dict(self):
        return {"latency_s": self.latency_s, "bandwidth_bps": self.bandwidth_bps, "source": self.source}


def link_from_rate(bps, latency_s=None, source="given"):
    """A Link of `bps` bits per second (and DEFAULT_LATENCY_S unless given)."""
    return Link(DEFAULT_LATENCY_S if latency_s is None else float(latency_s), float(bps) / 8.0, source)


_PINGPONG = r'''
import json, statistics, time
import numpy as np
from launcher.world import join_local
from training import collectives
comm, rank, _ = join_local()
collectives.set_polite(rank == 1 and POLITE)
wait = collectives.wait


def work():                                     # a rank computes between its messages
    t = time.perf_counter()
    while time.perf_counter() - t < WORK:
        pass


out = {}
for size, reps, pool in SIZES:
    bufs = [np.ones(size, np.uint8) for _ in range(pool)]
    trials = []
    for trial in range(TRIALS + 1):
        comm.Barrier()
        t = time.perf_counter()
        for i in range(reps):
            buf = bufs[i % pool]
            if rank == 0:
                work(); wait(comm.Isend(buf, 1, 5)); wait(comm.Irecv(buf, 1, 5))
            else:
                wait(comm.Irecv(buf, 0, 5)); work(); wait(comm.Isend(buf, 0, 5))
        if trial:                                   # the first trial warms up
            trials.append(((time.perf_counter() - t) / reps - 2 * WORK) / 2)
    out[size] = min(trials) if not LOADED else statistics.median(trials)
if rank == 0:
    print("PINGPONG " + json.dumps(out), flush=True)
'''


def _run_pair(code, tag, timeout, what):
    """Run `code` on two joined ranks (launcher.world.run_local); rank 0's `TAG {json}` line."""
    from launcher.world import run_local
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    try:
        outs = run_local([sys.executable, "-c", code], 2, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PlanError(f"the MPI {what} did not finish in {timeout}s; give the link with --bandwidth") from None
    lines = [ln for ln in outs[0][1].splitlines() if ln.startswith(tag + " ")]
    if any(rc != 0 for rc, _, _ in outs) or not lines:
        tail = next((e.strip().splitlines()[-1] for _, _, e in outs if e.strip()), "no output")
        raise PlanError(f"the MPI {what} failed ({tail}); give the link with --bandwidth")
    return json.loads(lines[-1][len(tag) + 1:])


_HOG = r'''
import time
while True:                         # DUTY of every millisecond busy, the rest asleep
    t = time.perf_counter()
    while time.perf_counter() - t < DUTY * 1e-3:
        pass
    if DUTY < 1:
        time.sleep((1 - DUTY) * 1e-3)
'''


def _pingpong(sizes, trials, timeout, busy=0, polite=False, duty=1.0):
    """{size: one-way seconds} of a ping-pong between two joined ranks (measure_link)."""
    code = (_PINGPONG.replace("SIZES", repr(sizes)).replace("TRIALS", str(trials))
            .replace("POLITE", repr(bool(polite))).replace("LOADED", repr(busy > 0))
            .replace("WORK", "1e-3" if busy else "0.0"))
    hog = _HOG.replace("DUTY", repr(float(duty)))
    hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(busy)]
    try:
        out = _run_pair(code, "PINGPONG", timeout, "ping-pong")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return {int(k): v for k, v in out.items()}


_WAIT_CPU = r'''
import json, time
import numpy as np
from launcher.world import join_local
from training import collectives
comm, rank, _ = join_local()
collectives.set_polite(True)
small, out = np.zeros(8, np.uint8), {}
pool = {n: [np.zeros(n, np.uint8) for _ in range(4)] for n in SIZES}    # cold, as a step's tensors
plan = [(x, str(x)) for x in LATE] + [(0.005, n) for n in SIZES] * BCASTS
for i, (late, key) in enumerate(plan):
    comm.Barrier()
    if rank == 0:
        t = time.perf_counter()
        while time.perf_counter() - t < late:
            pass
    if isinstance(key, int):                    # a collective, as the strategies move data
        c, t = time.process_time(), time.perf_counter()
        collectives.wait(comm.Ibcast(pool[key][i % 4], root=0))
        key = "b%d" % key
    elif rank == 0:
        collectives.wait(comm.Isend(small, 1, 5))
        comm.Recv(small, 1, 6)
        continue
    else:
        c, t = time.process_time(), time.perf_counter()
        collectives.wait(comm.Irecv(small, 0, 5))
    if rank == 1:
        out.setdefault(key, []).append([time.process_time() - c, time.perf_counter() - t])
        if not key.startswith("b"):
            comm.Send(small, 0, 6)
comm.Barrier()
if rank == 0:
    print("WAITCPU " + json.dumps(comm.recv(source=1)), flush=True)
else:
    comm.send(out, dest=0)
'''


def _slope(points):
    """The least-squares slope through (x, y) points."""
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-18)


def measure_wait_cpu(late=(0.002, 0.005, 0.02), repeat=10, timeout=60, sizes=(8, 256 << 10, 1 << 20),
                     bcasts=20):
    """(a, r, b): what a polite wait (training.collectives.wait, as throttled ranks and
    conv-MP workers wait) costs in CPU: a seconds for every wait (its 0.2 ms spin, the
    first short sleeps) plus r seconds per second it lasts (a wake-up every ~0.2 ms to
    test) plus b seconds per byte it receives (MPI copies the message inside the wait).
    Two joined ranks, one computing `late` seconds before it sends 8 bytes, the other
    waiting and counting its own CPU seconds; a line fitted through the median of each
    `late` (a stall of the machine in one wait does not tilt it) gives a and r. Then
    broadcasts of each of `sizes` bytes after 5 ms (the strategies move data in
    collectives), interleaved, `bcasts` of each, from buffers not in the cache (a step's
    activations are not): b is the slope, over the sizes, of the median CPU beyond r·wait.
    Measured here: a ~0.25 ms, r ~0.1, b 0.1-0.25 ns (0.1-0.25 ms per MB)."""
    code = (_WAIT_CPU.replace("LATE", repr(list(late) * repeat)).replace("SIZES", repr(list(sizes)))
            .replace("BCASTS", str(int(bcasts))))
    out = _run_pair(code, "WAITCPU", timeout, "wait probe")
    sent = {int(k[1:]): out.pop(k) for k in list(out) if k.startswith("b")}
    points = [(statistics.median(w for _, w in xs), statistics.median(c for c, _ in xs)) for xs in out.values()]
    r = min(max(_slope(points), 0.0), 1.0)
    a = statistics.fmean(c for _, c in points) - r * statistics.fmean(w for w, _ in points)
    b = _slope([(n, statistics.median(c - r * w for c, w in xs)) for n, xs in sent.items()])
    return max(0.0, a), r, max(0.0, b)


def measure_link(small=8, large=4 << 20, pool=16, trials=8, timeout=120, busy=0, polite=False, duty=1.0):
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
    """
    t = _pingpong([(small, 200, 1), (large, pool, pool)], trials, timeout)
    alpha = t[small]
    beta = (large - small) / max(t[large] - t[small], 1e-12)
    if not busy:
        return Link(alpha, beta, "measured (ping-pong of 2 joined ranks on this machine)")
    loaded = _pingpong([(small, 100, 1)], trials, timeout, busy, polite, duty)[small]
    return Link(max(alpha, loaded), beta,
                f"measured (ping-pong of 2 joined ranks on this machine; latency with {busy} "
                f"process{'es' if busy > 1 else ''} {100 * duty:.0f}% busy{', polite' if polite else ''})",
                idle_latency_s=alpha)


_STRATEGY_CPU = r"""
import json, statistics, time
import torch
from training import collectives
spent, counted_s, hooks_s = [0.0], [0.0], [0.0]  # CPU in waits; in what the planner times itself (the
                                                # model's forward + backward, conv shares, the
                                                # optimizer); in gradient hooks


def counted(f, into=counted_s):
    def run(*args, **kwargs):
        c = time.process_time()
        try:
            return f(*args, **kwargs)
        finally:
            into[0] += time.process_time() - c
    return run


collectives.wait = counted(collectives.wait, spent)   # every wait, before the strategies' modules bind it
import conf
from launcher.world import join_local
from training import model_parallel, strategies
from training.context import RunContext
from training.models import build_model
from training.runner import make_optimizer_factory
from training.collectives import GradientReducer
from training.strategies.allreduce import AllReduceStrategy
from training.strategies.conv_mp import ConvModelParallelStrategy
model_parallel._ShardConv2d.forward = staticmethod(counted(model_parallel._ShardConv2d.forward))
model_parallel._ShardConv2d.backward = staticmethod(counted(model_parallel._ShardConv2d.backward))
AllReduceStrategy._forward_backward = counted(AllReduceStrategy._forward_backward)   # and the PS ones
GradientReducer._on_grad = counted(GradientReducer._on_grad, hooks_s)                # run in backward
protocol_s, depth = [0.0], [0]                  # the conv-MP master's protocol, less its shares and waits


def protocol(f):
    def run(*args, **kwargs):
        if depth[0]:
            return f(*args, **kwargs)
        depth[0], c, inner = 1, time.process_time(), counted_s[0] + spent[0]
        try:
            return f(*args, **kwargs)
        finally:
            depth[0] = 0
            protocol_s[0] += time.process_time() - c - (counted_s[0] + spent[0] - inner)
    return run


for cls, names in ((model_parallel.DistributedConv2d, ["forward"]),
                   (model_parallel.ShardProtocol, ["_send", "finish"]),
                   (ConvModelParallelStrategy, ["_gather_times"])):
    for fn in names:
        setattr(cls, fn, protocol(getattr(cls, fn)))
for cls in (model_parallel._GatherChannelsToMaster, model_parallel._BroadcastFromMaster,
            model_parallel._AnnounceBackward):
    cls.backward = staticmethod(protocol(cls.backward))
a = json.loads(ARGS)
comm, rank, n = join_local()
torch.set_num_threads(1)
polite = rank > 0                               # the second rank waits as a throttled one does
collectives.set_polite(polite)
g = torch.Generator().manual_seed(1)
x = torch.randn(a["batch"], *a["shape"], generator=g)
y = torch.randint(0, a["classes"], (a["batch"],), generator=g)
own = {}
for name in a["strategies"]:
    job = conf.load_job({"name": "probe", "groups": [{"name": "g", "instances": n}],
                         "training": {"strategy": name, "model": a["model"], "model_options": a["options"],
                                      "data": {"train": "file:///unused"}, "batch_size": a["batch"],
                                      "model_parallel": {"split": [1.0] * n, "layers": a["layers"]}}})
    torch.manual_seed(0)
    model = build_model(a["model"], tuple(a["shape"]), a["classes"], a["options"])
    s = strategies.get(name)(RunContext.offline(comm, job, "probe"), job.training)
    s.setup(model, make_optimizer_factory(job.training))
    if getattr(s, "optimizer", None) is not None:
        s.optimizer.step = counted(s.optimizer.step)
    lo, hi = s.batch_slice(a["batch"])
    xs, ys = (x[lo:hi], y[lo:hi]) if hi > lo else (None, None)
    for _ in range(3):
        s.train_step(xs, ys)
    comm.Barrier()
    steps, master = [], name == "conv_model_parallel" and rank == 0
    for _ in range(a["steps"]):
        spent[0], counted_s[0], hooks_s[0], protocol_s[0], c0 = 0.0, 0.0, 0.0, 0.0, time.process_time()
        s.train_step(xs, ys)
        steps.append(protocol_s[0] if master else
                     time.process_time() - c0 - counted_s[0] + hooks_s[0] - spent[0])
    own[name] = statistics.median(steps)
    if hasattr(s, "close"):
        s.close()
    comm.Barrier()
every = comm.gather(own, root=0)
if rank == 0:
    print("STRATEGYCPU " + json.dumps({k: [e[k] for e in every] for k in own}), flush=True)
"""


def measure_strategy_cpu(model_name, options, sample_shape, classes, batch, layers, strategies=STRATEGIES,
                         steps=20, timeout=180):
    """{strategy: [rank 0's, a worker's]} seconds of CPU a rank spends per step beyond
    what the planner times and counts itself: the model's forward + backward on its rows
    (the profile), conv shares, the optimizer, the waits (measure_wait_cpu). That is the
    strategy's own work: gradient hooks and bucket copies, packing a flat gradient,
    summing the server's gradients, the conv-MP protocol's Python and autograd, the MPI
    calls. Every strategy runs for real on two joined ranks (batch split equally, the
    second rank waiting politely as a throttled one does, one thread each); per step its
    CPU time minus what it spent in the model's forward + backward (less the gradient
    hooks run inside it), its conv shares, the optimizer and its waits; for the conv-MP
    master (whose step also runs the rest of the network, which the profile has), the
    CPU of its protocol alone: the distributed layers' forward, the backward of their
    broadcast and gather, its commands to the workers, less its shares and waits inside
    them. The median over `steps` steps; CPU time throughout: a busy machine slows the
    probe but does not change what it counts. Here, seed_cnn: ~0.5-1 ms for the
    data-parallel strategies, ~3 ms for a conv-MP worker; on a 0.5-vcore rank that
    comes out of its quota."""
    strategies = [k for k in strategies if k != "conv_model_parallel" or layers]
    args = {"model": model_name, "options": dict(options), "shape": list(sample_shape), "classes": int(classes),
            "batch": int(batch), "layers": list(layers or []), "steps": int(steps), "strategies": strategies}
    code = _STRATEGY_CPU.replace("ARGS", repr(json.dumps(args)))
    out = _run_pair(code, "STRATEGYCPU", timeout, "strategy probe")
    return {k: [max(0.0, float(v)) for v in vs] for k, vs in out.items()}


# ----------------------------------------------------------------------------------------
# Compute: per-layer profile of the model on this machine
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Layer:
    """One leaf module call at batch B: forward + backward seconds and its tensors."""
    name: str
    kind: str                     # "conv" (nn.Conv2d), "linear" or "other"
    seconds: float
    params: int
    param_bytes: int
    in_bytes: int                 # |X| of the call
    out_bytes: int                # |Y|
    out_channels: int             # convs: kernels C; else 0
    needs_input_grad: bool        # an earlier layer needs dX
    distributable: bool           # a conv DistributedConv2d can split


@dataclasses.dataclass
class Profile:
    """Compute of one model at batch `batch` with `threads` threads on `device` (seconds)."""
    device: str
    threads: int
    batch: int
    layers: list
    step_s: float                 # t(B): whole forward + loss + backward
    intercept_s: float            # a of the affine fit t(b) = a + (t(B) − a) b / B
    optimizer_s: float            # one optimizer step over every parameter
    params: int
    param_bytes: int
    rows_s: dict = dataclasses.field(default_factory=dict)     # {rows: t(rows)} measured
    shares_s: dict = dataclasses.field(default_factory=dict)   # {"layer/kernels": seconds} measured
    idle_s: float = 0.0           # rows_s and shares_s timed after this long an idle pause each

    def fwd_bwd_s(self, rows):
        """t(rows): 0 for no rows, measured where it was (measure_rows), else the affine fit."""
        if rows <= 0:
            return 0.0
        if rows in self.rows_s:
            return self.rows_s[rows]
        return self.intercept_s + (self.step_s - self.intercept_s) * rows / self.batch

    def share_s(self, name, kernels):
        """Forward + backward of `kernels` of layer `name`'s kernels: measured where it was
        (measure_shares), else that fraction of the whole layer's time."""
        if kernels <= 0:
            return 0.0
        key = f"{name}/{kernels}"
        if key in self.shares_s:
            return self.shares_s[key]
        calls = self.layer(name)
        return kernels / calls[0].out_channels * sum(lay.seconds for lay in calls)

    def layer(self, name):
        found = [lay for lay in self.layers if lay.name == name]
        if not found:
            raise PlanError(f"layer {name!r} is not called in the model's forward pass")
        return found

    def as_dict(self):
        return dataclasses.asdict(self)




def _timed(fn, min_time, min_reps, sync=None, idle_s=0.0):
    """Mean seconds of fn() over at least min_reps runs and min_time seconds (after a warm-up):
    the mean, because a step time is predicted as the mean of many (a job's throughput);
    runs over 3x the median (a one-off stall of the machine) are left out.
    fn may return a callable run untimed before the next repetition (resetting state)."""
    reset = fn()
    if callable(reset):
        reset()
    times = []
    while len(times) < min_reps or sum(times) < min_time:
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        reset = fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
        if callable(reset):
            reset()
    typical = statistics.median(times)
    return statistics.fmean([t for t in times if t <= 3 * typical])   # not a one-off stall


def _leaf_calls(model, x, y):
    """[(name, module, input tensor, output shape)] of every leaf module call of one
    forward pass on x, in call order (the input keeps its requires_grad flag)."""
    calls = []

    def hook(name):
        def record(module, args, output):
            inp = args[0] if args and torch.is_tensor(args[0]) else None
            if inp is not None and torch.is_tensor(output):
                calls.append((name, module, inp.detach().requires_grad_(inp.requires_grad), tuple(output.shape)))
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if name and not list(m.children())]
    try:
        F.cross_entropy(model(x), y)
    finally:
        for h in handles:
            h.remove()
    return calls


def _time_layer(module, inp, min_time, min_reps, sync, idle_s=0.0):
    """Forward + backward seconds of one module on a copy of its recorded input."""
    x0 = torch.randn_like(inp).requires_grad_(inp.requires_grad)
    params = [p for p in module.parameters() if p.requires_grad]
    probe = module(x0.clone() if x0.requires_grad else x0)
    grad = torch.randn_like(probe) if probe.requires_grad else None

    def once():
        out = module(x0.clone() if x0.requires_grad else x0)
        if grad is not None:
            out.backward(grad)

        def reset():
            for p in params:
                p.grad = None
            x0.grad = None
        return reset
    return _timed(once, min_time, min_reps, sync, idle_s)


class _Probe:
    """What every measurement times: a training copy of the model on `device` (the model
    itself is left as it is) and random batches of its input shape (seeded: the same
    batches every time)."""

    def __init__(self, model, sample_shape, device):
        self.dev = torch.device(device)
        self.sync = (lambda: torch.cuda.synchronize(self.dev)) if self.dev.type == "cuda" else None
        self.model = copy.deepcopy(model).to(self.dev).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.shape = tuple(sample_shape)
        self.num_classes = _num_classes(self.model, sample_shape, self.dev)
        self._g = torch.Generator().manual_seed(0)

    def data(self, rows):
        x = torch.randn((rows, *self.shape), generator=self._g).to(self.dev)
        return x, torch.randint(0, self.num_classes, (rows,), generator=self._g).to(self.dev)

    def whole(self, x, y):
        """One forward + loss + backward of the whole model, for _timed (gradients reset after)."""
        def once():
            F.cross_entropy(self.model(x), y).backward()
            return lambda: [setattr(p, "grad", None) for p in self.params]
        return once


def measure_profile(model, sample_shape, batch, make_optimizer, threads=1, device="cpu",
                    min_time=0.1, min_reps=3):
    """The Profile of `model` on inputs (batch, *sample_shape) with `threads` threads.

    Works on a copy (the model, its gradients and buffers are left as they are). Each
    item (every leaf module call, the whole model at B and at B/4, the optimizer step)
    is timed for at least `min_time` seconds and `min_reps` runs; the mean counts.
    """
    pr = _Probe(model, sample_shape, device)
    dev, sync, params = pr.dev, pr.sync, pr.params
    small = max(1, batch // 4)
    with num_threads(threads):
        x, y = pr.data(batch)
        layers = []
        for name, module, inp, out_shape in _leaf_calls(pr.model, x, y):
            seconds = _time_layer(module, inp, min_time, min_reps, sync)
            own = [p for p in module.parameters() if p.requires_grad]
            is_conv = isinstance(module, nn.Conv2d)
            layers.append(Layer(
                name=name, kind="conv" if is_conv else "linear" if isinstance(module, nn.Linear) else "other",
                seconds=seconds, params=sum(p.numel() for p in own),
                param_bytes=sum(p.numel() * p.element_size() for p in own),
                in_bytes=inp.numel() * inp.element_size(),
                out_bytes=math.prod(out_shape) * inp.element_size(),
                out_channels=module.out_channels if is_conv else 0,
                needs_input_grad=bool(inp.requires_grad),
                distributable=is_conv and why_not_distributable(module) is None))

        step_s = _timed(pr.whole(x, y), min_time, min_reps, sync)
        small_s = _timed(pr.whole(*pr.data(small)), min_time, min_reps, sync)
        optimizer = make_optimizer(params)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer_s = _timed(optimizer.step, min_time, min_reps, sync)
    # Layers timed one by one add up to a little more or less than the whole model (timer
    # noise; the loss and autograd's bookkeeping belong to no layer). More: scale them down
    # to the whole, keeping their proportions; less: the remainder runs on the master.
    total = sum(lay.seconds for lay in layers)
    if total > step_s:
        for lay in layers:
            lay.seconds *= step_s / total
    if small < batch:   # t(b) = a + k b through (small, t_small) and (B, t_B)
        intercept = (small_s * batch - step_s * small) / (batch - small)
    else:
        intercept = 0.0
    intercept = min(max(intercept, 0.0), step_s)
    return Profile(device=dev.type, threads=int(threads), batch=int(batch), layers=layers,
                   step_s=step_s, intercept_s=intercept, optimizer_s=optimizer_s,
                   params=sum(p.numel() for p in params),
                   param_bytes=sum(p.numel() * p.element_size() for p in params))


def measure_rows(profile, model, sample_shape, rows, min_time=0.1, min_reps=3):
    """Add t(r) for each row count r in `rows` to profile.rows_s (whole forward + loss +
    backward at exactly the rows a rank will get: the time per row is not constant, so
    the affine fit through B and B/4 can be 10% off at other counts)."""
    pr = _Probe(model, sample_shape, profile.device)
    with num_threads(profile.threads):
        for r in sorted({int(r) for r in rows if r > 0} - set(profile.rows_s)):
            profile.rows_s[r] = _timed(pr.whole(*pr.data(r)), min_time, min_reps, pr.sync, profile.idle_s)
    return profile


def measure_shares(profile, model, sample_shape, layer_split, min_time=0.1, min_reps=3):
    """Add the forward + backward seconds of every share in `layer_split` ({layer: kernels
    per rank}) to profile.shares_s: a conv of that many kernels on the layer's real input,
    as DistributedConv2d runs it (a small share is slower per kernel than the whole layer)."""
    pr = _Probe(model, sample_shape, profile.device)
    calls = {}
    for name, module, inp, _ in _leaf_calls(pr.model, *pr.data(profile.batch)):
        calls.setdefault(name, []).append((module, inp))
    with num_threads(profile.threads):
        for name, counts in layer_split.items():
            for c in sorted(set(counts)):
                key = f"{name}/{c}"
                if c <= 0 or key in profile.shares_s or name not in calls:
                    continue
                total = 0.0
                for module, inp in calls[name]:
                    part = nn.Conv2d(module.in_channels, c, module.kernel_size, module.stride, module.padding,
                                     module.dilation, bias=module.bias is not None).to(pr.dev)
                    total += _time_layer(part, inp, min_time, min_reps, pr.sync, profile.idle_s)
                profile.shares_s[key] = total
    return profile


IDLE_S = 0.02    # the pause before each run of an idle profile: about half a step of waiting


def idle_profile(profile, idle_s=IDLE_S):
    """A copy of `profile` whose rows and shares will be timed after `idle_s` of sleep each.

    A rank that sleeps while it waits (a throttled rank; a conv-MP worker while the master
    runs the rest of the network) computes with cold caches and a CPU the host may have
    given away: measured here, 11 rows of seed_cnn took 21.8 ms of CPU after 20 ms pauses
    against 17.9 ms back to back. measure_rows/measure_shares fill it."""
    return dataclasses.replace(profile, rows_s={}, shares_s={}, idle_s=float(idle_s))


def _num_classes(model, sample_shape, dev):
    with torch.no_grad():
        out = model(torch.zeros((1, *sample_shape), device=dev))
    return int(out.shape[1])


# ----------------------------------------------------------------------------------------
# Devices and predictions
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Device:
    """A rank's compute: the Profile's seconds divided by speed × quota.

    speed: a device factor (1 for the profile's own device; a simulated GPU's factor);
    quota: v/k for a container of v vcores running k threads (< 1: CPU-throttled).
    `full=True` gives the times at full speed (÷ speed only): what the rank computes
    between two stops of its quota (quota_sim)."""
    name: str
    profile: Profile
    speed: float = 1.0
    vcores: float = 1.0
    quota: float = 1.0
    idle: Optional[Profile] = None    # rows and shares timed after idle pauses (`idle_profile`)

    @property
    def factor(self):
        return self.speed * self.quota

    def _after_idle(self, waits):
        return self.idle if waits and self.idle is not None else self.profile

    def _per(self, full):
        return self.speed if full else self.factor

    def fwd_bwd_s(self, rows, full=False):
        """A throttled rank waits politely (it sleeps), so it computes after idle pauses."""
        return self._after_idle(self.quota < 1.0).fwd_bwd_s(rows) / self._per(full)

    def layer_s(self, name):
        return sum(lay.seconds for lay in self.profile.layer(name)) / self.factor

    def share_s(self, name, kernels, worker=False, full=False):
        """A conv-MP worker sleeps while the master runs the rest of the network."""
        return self._after_idle(worker or self.quota < 1.0).share_s(name, kernels) / self._per(full)

    def optimizer_s(self, fraction=1.0, full=False):
        return self.profile.optimizer_s * fraction / self._per(full)

    def sim_rank(self, sched, polite=False):
        """This device as quota_sim sees it: a polite rank (throttled, or a conv-MP
        worker) burns sched.wait_cpu of its speed while it waits, any other spins."""
        polite = polite or self.quota < 1.0
        return quota_sim.Rank(quota=self.quota, threads=self.profile.threads, weight=self.vcores,
                              wait_cpu=sched.wait_cpu if polite else 1.0,
                              wait_s=sched.wait_s if polite else 0.0)

    @property
    def step_s(self):
        """The whole batch on this device alone: forward, backward, optimizer."""
        return self.fwd_bwd_s(self.profile.batch) + self.optimizer_s()


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """How the ranks get their CPUs: `cores` they share (the local engine: this
    machine's; None: each container has its own, as on YARN), the CFS period of their
    quotas, and what a polite wait costs in CPU: `wait_s` for each wait plus `wait_cpu`
    of a CPU while it lasts plus `byte_s` per byte it receives (`measure_wait_cpu`; here
    ~0.3 ms, ~0.1 and ~0.2 ns)."""
    cores: Optional[int] = None
    wait_s: float = 0.3e-3
    wait_cpu: float = 0.1
    byte_s: float = 0.0
    period_s: float = quota_sim.PERIOD_S

    def step_s(self, devices, phases, syncs, waits, polite=()):
        """quota_sim's mean step of `devices` running `phases` (full-speed seconds per
        rank) each ended by the synchronisation in `syncs`, with waits[k] waits in phase
        k; `polite`: ranks that wait politely whatever their quota (conv-MP workers)."""
        ranks = [d.sim_rank(self, r in polite) for r, d in enumerate(devices)]
        return quota_sim.step_s(phases, syncs, ranks, self.cores, self.period_s, waits=waits)


def share_weights(devices, shares):
    """One weight per rank for `shares` (equal | vcores | speed | a list), as the strategies
    weigh them; 'speed' is rows per second of each device's forward + backward."""
    n = len(devices)
    if isinstance(shares, (list, tuple)):
        if len(shares) != n:
            raise PlanError(f"training.shares: {len(shares)} shares given for {n} ranks")
        return [float(s) for s in shares]
    if shares == "equal":
        return [1.0] * n
    if shares == "vcores":
        return [float(d.vcores) for d in devices]
    if shares == "speed":
        return [1.0 / d.fwd_bwd_s(d.profile.batch) for d in devices]
    raise PlanError(f"training.shares: expected equal, vcores, speed or a list, got {shares!r}")


def _prediction(strategy, devices, step_s, compute_s, comm_s, split, **extra):
    single = devices[0].step_s
    return dict({"strategy": strategy, "ranks": len(devices), "step_s": step_s, "compute_s": compute_s,
                 "comm_s": comm_s, "speedup": single / step_s, "split": split}, **extra)


def _data_parallel(strategy, devices, link, batch, shares, sched=Scheduling(), bucket_mb=4.0,
                   ring_threshold_kb=256.0, own=(0.0, 0.0)):
    """Step of a data-parallel strategy: its seed formula on the (throttled) devices,
    played out under their quotas (quota_sim) where any is throttled or cores are shared.
    own: the strategy's own CPU seconds per step on rank 0 and on every other rank
    (measure_strategy_cpu), added to each rank's compute."""
    n, w = len(devices), devices[0].profile.param_bytes
    rows = split_rows(batch, share_weights(devices, shares))
    lg, a, bw = _log2(n), link.latency_s, link.bandwidth_Bps
    mine = _per_rank(own, n)
    rank_s = [d.fwd_bwd_s(r) + o / d.quota for d, r, o in zip(devices, rows, mine)]
    g = max(rank_s)                                             # the slowest share
    if strategy == "allreduce":
        opt_part = [1.0] * n
        comm = 2 * (n - 1) / n * w / bw + 2 * (n - 1) * a
    elif strategy == "ps_central":
        opt_part = [1.0] + [0.0] * (n - 1)
        comm = central_ps_s(n - 1, link.seconds(w), 0.0)[1]
    else:
        opt_part = [1.0 / n] * n
        comm = sharded_ps_s(n, w / bw, 0.0) + 2 * a
    opt = max(d.optimizer_s(f) for d, f in zip(devices, opt_part) if f)
    comm = comm + 2 * lg * a if n > 1 else 0.0
    # compute, the exchange (every rank waits for it), the optimizer, the next step's
    # row count all-reduce (a barrier); a rank's waits in a step: the row count and the
    # loss all-reduces, and the exchange's (each gradient bucket's, or one send and one
    # receive)
    if strategy == "allreduce":
        buckets = max(1, math.ceil(w / (bucket_mb * 2**20)))
        exchange = buckets * (2 * (n - 1) if w / buckets >= ring_threshold_kb * 1024 else 1)
    else:
        exchange = 2
    # what a rank receives in the exchange: a polite one copies it inside its waits
    got = ([2 * (n - 1) / n * w] * n if strategy != "ps_central" else [(n - 1) * w] + [w] * (n - 1)) \
        if n > 1 else [0.0]
    copies = [b * sched.byte_s if d.quota < 1.0 else 0.0 for d, b in zip(devices, got)]
    step = sched.step_s(devices, [[d.fwd_bwd_s(r, full=True) + o + c
                                   for d, r, o, c in zip(devices, rows, mine, copies)],
                                  [d.optimizer_s(f, full=True) for d, f in zip(devices, opt_part)]],
                        [comm, 0.0], [2 + exchange if n > 1 else 0, 0])
    extra = {"rank_s": rank_s, "formula_s": g + opt + comm}
    if strategy == "ps_central" and n > 1:
        best, worst = central_ps_s(n - 1, link.seconds(w), g)
        extra["bounds"] = [best + opt, worst + opt]
    return _prediction(strategy, devices, step, step - comm, comm, rows, **extra)


def predict_allreduce(devices, link, batch, shares="equal", sched=Scheduling(), bucket_mb=4.0,
                      ring_threshold_kb=256.0, own=(0.0, 0.0)):
    """Ring all-reduce: g + max_r o_r + 2(n−1)/n·|W|/β + 2(n−1)α + 2⌈log2 n⌉α (bucket_mb,
    ring_threshold_kb: training.allreduce's, for the number of waits per step; own:
    _data_parallel's)."""
    return _data_parallel("allreduce", devices, link, batch, shares, sched, bucket_mb, ring_threshold_kb, own)


def predict_central_ps(devices, link, batch, shares="equal", sched=Scheduling(), own=(0.0, 0.0)):
    """Central server on rank 0 with m = n−1 remote workers: g + 2mc + o_0 (seed 4's upper
    bound; `bounds` holds both of seed 4's, (m+1)c + g and 2mc + g, plus o_0)."""
    return _data_parallel("ps_central", devices, link, batch, shares, sched, own=own)


def predict_sharded_ps(devices, link, batch, shares="equal", sched=Scheduling(), own=(0.0, 0.0)):
    """Sharded server: g + 2(n−1)/n·|W|/β + 2α + max_r o_r / n."""
    return _data_parallel("ps_sharded", devices, link, batch, shares, sched, own=own)


def _bcast_s(nbytes, n, link):
    """MPI broadcast (or reduce) of nbytes over n ranks: tree or scatter + all-gather."""
    if n <= 1:
        return 0.0
    a, b, lg = link.latency_s, link.bandwidth_Bps, _log2(n)
    return min(lg * (a + nbytes / b), 2 * (n - 1) / n * nbytes / b + (lg + n - 1) * a)


def conv_layers_of(profile, names=None):
    """The distributed convs: `names` (training.model_parallel.layers) or every distributable one."""
    convs = [lay for lay in profile.layers if lay.kind == "conv"]
    if names is not None:
        known = {lay.name for lay in convs}
        unknown = [x for x in names if x not in known]
        if unknown:
            raise PlanError(f"training.model_parallel.layers: {unknown} are not Conv2d layers of the "
                            f"model; its Conv2d layers are {sorted(known)}")
        return list(dict.fromkeys(x for x in (lay.name for lay in convs) if x in set(names)))
    return list(dict.fromkeys(lay.name for lay in convs if lay.distributable))


def conv_fraction(device, names):
    """f: the distributed convs' share of one device's whole step (seed 1's bound)."""
    return sum(device.layer_s(x) for x in names) / device.step_s


def _conv_split(devices, names, split):
    """{layer: kernels per rank}: `split` weights, else in proportion to the devices' speed on
    each layer; None where a layer has fewer kernels than there are ranks."""
    out = {}
    for name in names:
        kernels = devices[0].profile.layer(name)[0].out_channels
        weights = split if split is not None else [1.0 / d.layer_s(name) for d in devices]
        try:
            out[name] = proportional_split(kernels, weights)
        except ValueError:
            return None
    return out


def _conv_times(devices, link, names, layer_split):
    """(rest on the master, [(each rank's full-speed share, comm) per layer], the
    communication in all, the fraction of the master's optimizer step it still runs)."""
    n, master = len(devices), devices[0]
    prof = master.profile
    lg, a, b = _log2(n), link.latency_s, link.bandwidth_Bps
    rest = max(0.0, master.fwd_bwd_s(prof.batch) - sum(master.layer_s(x) for x in names))
    layers, comm, moved = [], 0.0, 0.0
    for name in names:
        calls, counts = prof.layer(name), layer_split[name]
        kernels = sum(counts)
        shares = [d.share_s(name, c, worker=r > 0, full=True) for r, (c, d) in enumerate(zip(counts, devices))]
        away = 1.0 - counts[0] / kernels
        moved += calls[0].param_bytes * away
        layer_comm = 0.0
        if n > 1:
            for call in calls:
                layer_comm += _bcast_s(call.in_bytes, n, link) + 2 * away * call.out_bytes / b + 5 * lg * a
                if call.needs_input_grad:
                    layer_comm += _bcast_s(call.in_bytes, n, link)
        layers.append((shares, layer_comm))
        comm += layer_comm
    if n > 1:
        comm += (2 * len(names) + 2) * lg * a
    return rest, layers, comm, 1.0 - moved / prof.param_bytes


def predict_conv_mp(devices, link, names, split=None, sched=Scheduling(), own=(0.0, 0.0)):
    """Conv-layer model parallelism, rank 0 the master (formula in the module docstring),
    played out under the ranks' quotas (quota_sim; the workers wait politely).

    split: kernel weights, one per rank (training.model_parallel.split), else each
    layer's kernels in proportion to the devices' speed on it. own: the master's protocol
    CPU per step and a worker's CPU per step besides its shares and waits
    (measure_strategy_cpu), spread over the layers by their calls. Returns None where a
    layer has fewer kernels than there are ranks
    (it cannot be split).
    """
    layer_split = _conv_split(devices, names, split)
    if layer_split is None:
        return None
    n, master = len(devices), devices[0]
    B = master.profile.batch
    rest, layers, comm, opt_part = _conv_times(devices, link, names, layer_split)
    protocol = (2 * len(names) + 2) * _log2(n) * link.latency_s if n > 1 else 0.0
    idle = [0.0] * (n - 1)
    calls = [len(master.profile.layer(x)) for x in names]
    mine = _per_rank(own, n)
    # a worker copies what it receives and sends inside its (polite) waits: X, its share
    # of Y and of dY, and dX where it is needed
    copied = [[sum(call.in_bytes * (1 + call.needs_input_grad) + 2 * c / sum(layer_split[x]) * call.out_bytes
                   for call in master.profile.layer(x)) * sched.byte_s if r else 0.0
               for r, c in enumerate(layer_split[x])] for x in names]
    layers = [([t + o * c / sum(calls) + b for t, o, b in zip(shares, mine, copy_l)], comm_l)
              for (shares, comm_l), c, copy_l in zip(layers, calls, copied)]
    # each layer's shares (and the workers' protocol) and its exchanges; the rest of the
    # network on the master (at full speed: rest is at its quota already); the master's
    # optimizer and the step's protocol
    phases = [shares for shares, _ in layers] + [[rest * master.quota] + idle,
                                                 [master.optimizer_s(opt_part, full=True)] + idle]
    # a worker's waits: per call of a layer, the command, X's broadcast and the gather in
    # forward, the command and the scatter in backward (and dX's reduce where needed);
    # the step's end and the gather of conv times
    waits = [sum(5 + call.needs_input_grad for call in master.profile.layer(x)) for x in names] + [0, 2]
    step = sched.step_s(devices, phases, [c for _, c in layers] + [0.0, protocol], waits, polite=range(1, n))
    conv_s = sum(max(d.share_s(x, c, worker=r > 0) for r, (c, d) in enumerate(zip(layer_split[x], devices)))
                 for x in names)
    speeds = [1.0 / d.fwd_bwd_s(B) for d in devices]
    f = conv_fraction(master, names)
    k = sum(speeds) / speeds[0]
    ideal = sum(proportional_s([d.layer_s(x) for d in devices]) for x in names)
    formula = rest + conv_s + comm + master.optimizer_s(opt_part)
    rank_s = [sum(p[r] for p in phases) / d.quota for r, d in enumerate(devices)]   # each one's compute
    return _prediction("conv_model_parallel", devices, step, step - comm, comm, layer_split,
                       rank_s=rank_s, formula_s=formula, conv_s=conv_s, conv_ideal_s=ideal, rest_s=rest,
                       conv_fraction=f, effective_devices=k, bound=amdahl_bound(f, k))


def predict_all(devices, link, batch, shares="equal", conv_names=None, conv_split=None, sched=Scheduling(),
                allreduce=None, own=None):
    """{strategy: prediction} for one cluster (devices[0] = rank 0, the master/server);
    allreduce: {bucket_mb, ring_threshold_kb} of the job; own: {strategy: [rank 0's, the
    others']} CPU seconds of the strategy's own per step (measure_strategy_cpu; none: 0)."""
    names = conv_names if conv_names is not None else conv_layers_of(devices[0].profile)
    own = own_cpu(own)
    return {"allreduce": predict_allreduce(devices, link, batch, shares, sched, **(allreduce or {}),
                                           own=own["allreduce"]),
            "ps_central": predict_central_ps(devices, link, batch, shares, sched, own["ps_central"]),
            "ps_sharded": predict_sharded_ps(devices, link, batch, shares, sched, own["ps_sharded"]),
            "conv_model_parallel": predict_conv_mp(devices, link, names, conv_split, sched,
                                                   own["conv_model_parallel"]) if names else None}


def _per_rank(own, n):
    """One own-CPU figure per rank from (rank 0's, the others'); a single rank has none
    (no exchange, no protocol)."""
    return [own[0] if r == 0 else own[1] for r in range(n)] if n > 1 else [0.0]


def own_cpu(measured=None):
    """{strategy: (rank 0's, the others')} own CPU seconds per step: `measured`
    (measure_strategy_cpu's) where it has them, else 0 (None counts as 0)."""
    measured = measured or {}
    return {k: tuple(float(v or 0.0) for v in measured.get(k) or (0.0, 0.0)) for k in STRATEGIES}


# ----------------------------------------------------------------------------------------
# A job's plan
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How to plan. The job's link is measured (MPI ping-pong) with measure_link, else the
    first of `bandwidths_bps` (with latency_s, default DEFAULT_LATENCY_S), else the job's
    network.bandwidth, else measured; the simulated clusters use every bandwidth given."""
    measure_link: bool = False
    bandwidths_bps: tuple = ()        # simulated clusters (and the job unless measured)
    latency_s: float = None
    machines: tuple = (1, 2, 4, 8, 16)
    gpu_speed: float = None           # simulated GPU = rank 0's device × this speed
    min_time: float = 0.1             # seconds each timed item runs (at least 3 runs)
    input_shape: tuple = None         # (C, H, W) when the job's data cannot be read
    num_classes: int = None
    wait_cpu: tuple = None            # (a, r[, b]) of a polite wait (default: measure_wait_cpu)
    strategy_cpu: dict = None         # the strategies' own CPU per step (default: measure_strategy_cpu)


def parse_options(measure=False, bandwidth=None, latency=None, machines=None, gpu_speed=None,
                  quick=False, input_shape=None, classes=None):
    """PlanOptions from command-line strings: bandwidth '1gbit[,10gbit]', latency '0.05ms',
    machines '1,2,4', input_shape '1x8x8'."""
    from conf.units import parse_duration_s, parse_rate_bps

    def items(text):
        return [s.strip() for s in str(text).split(",") if s.strip()]
    try:
        bws = tuple(parse_rate_bps(b) for b in items(bandwidth)) if bandwidth else ()
        lat = parse_duration_s(latency) if latency else None
        mach = tuple(int(m) for m in items(machines)) if machines else PlanOptions.machines
        shape = tuple(int(s) for s in str(input_shape).lower().split("x")) if input_shape else None
    except ValueError as e:
        raise PlanError(f"plan options: {e}") from None
    if any(m < 1 for m in mach) or not mach:
        raise PlanError(f"--machines: expected positive integers such as 1,2,4,8,16, got {machines!r}")
    if shape is not None and len(shape) != 3:
        raise PlanError(f"--input-shape: expected CxHxW such as 3x32x32, got {input_shape!r}")
    if gpu_speed is not None and gpu_speed <= 0:
        raise PlanError(f"--gpu-speed: must be > 0, got {gpu_speed}")
    return PlanOptions(measure_link=bool(measure), bandwidths_bps=bws, latency_s=lat, machines=mach,
                       gpu_speed=gpu_speed, min_time=QUICK_MIN_TIME if quick else PlanOptions.min_time,
                       input_shape=shape, num_classes=classes)


def _input_of(spec, options):
    """((C, H, W), classes, where from) of the job's data, or the options', or a default."""
    if options.input_shape:
        return tuple(options.input_shape), options.num_classes or 10, "given"
    try:
        from training.data import open_dataset
        ds = open_dataset(spec.data, "train")
        return tuple(ds.shape), int(ds.num_classes), spec.data.train or spec.data.dataset
    except Exception as e:  # noqa: BLE001 - any unreadable dataset falls back to an assumption
        shape = DEFAULT_INPUT.get(spec.model, FALLBACK_INPUT)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        return shape, options.num_classes or 10, f"assumed (data not readable: {why})"


def local_load(job):
    """{busy, polite, duty} for measure_link: how many more ranks than cores this machine
    runs for the job on the local engine, whether a throttled rank waits politely, and how
    busy those extra ranks keep a CPU (their vcores, the last ranks', at most 1 each)."""
    ranks = [r for g in job.groups for r in [g] * g.instances]
    busy = max(0, len(ranks) - (os.cpu_count() or 1)) if job.backend == "local" else 0
    extra = ranks[len(ranks) - busy:] if busy else []
    duty = statistics.fmean(min(1.0, g.vcores) for g in extra) if extra else 1.0
    return {"busy": busy, "polite": any(g.vcores < max(1, math.ceil(g.vcores)) for g in ranks), "duty": duty}


def _job_link(job, options):
    if options.measure_link:
        return measure_link(**local_load(job))
    if options.bandwidths_bps:
        return link_from_rate(options.bandwidths_bps[0], options.latency_s)
    if job.network.bandwidth:
        return link_from_rate(job.network.bandwidth, options.latency_s or job.network.latency,
                              "the job's network.bandwidth")
    return measure_link(**local_load(job))


def _job_scheduling(job, devices, options):
    """The Scheduling of the job's ranks: on the local engine they share this machine's
    cores; a polite wait's CPU is measured where any rank waits politely (a throttled
    rank, or a conv-MP worker), unless given."""
    cores = (os.cpu_count() or 1) if job.backend == "local" else None
    if options.wait_cpu is not None:
        costs = tuple(options.wait_cpu)
    elif len(devices) > 1:
        costs = measure_wait_cpu()
    else:
        costs = (Scheduling.wait_s, Scheduling.wait_cpu)
    return Scheduling(cores, *costs)


def _make_optimizer_for(spec):
    from training.runner import make_optimizer_factory
    return make_optimizer_factory(spec)


def job_devices(job, profile_for, gpu_speed=None):
    """One Device per rank of `job`, in rank order. profile_for(threads, device) -> Profile.

    A group with GPUs is measured on CUDA when this machine has it; otherwise its device
    is rank 0-like CPU time divided by gpu_speed (an assumption, named in the device)."""
    devices = []
    for g in job.groups:
        k = max(1, math.ceil(g.vcores))
        if g.gpus and torch.cuda.is_available():
            dev = Device(f"{g.name} (cuda)", profile_for(k, "cuda"), vcores=g.vcores)
        elif g.gpus and gpu_speed:
            dev = Device(f"{g.name} (gpu ~ cpu x{gpu_speed:g}, assumed)", profile_for(k, "cpu"),
                         speed=gpu_speed, vcores=g.vcores)
        else:
            dev = Device(f"{g.name} ({g.vcores:g} vcores, {k} thread{'s' if k > 1 else ''})",
                         profile_for(k, "cpu"), vcores=g.vcores, quota=min(1.0, g.vcores / k))
        devices += [dev] * g.instances
    return devices


def _rounded(d):
    if isinstance(d, float):
        return float(f"{d:.6g}")
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_rounded(v) for v in d]
    return d


_CO_RUNNER = r'''
import json, sys
import torch
import torch.nn.functional as F
from training.models import build_model
a = json.loads(sys.argv[1])
torch.set_num_threads(1)
torch.manual_seed(0)
model = build_model(a["model"], tuple(a["shape"]), a["classes"], a["options"])
x = torch.randn(a["rows"], *a["shape"])
y = torch.randint(0, a["classes"], (a["rows"],))
F.cross_entropy(model(x), y).backward()
print("READY", flush=True)
while True:
    F.cross_entropy(model(x), y).backward()
'''


@contextlib.contextmanager
def co_runners(job, shape, classes, timeout=60):
    """While the job's ranks are measured, the other ranks' work runs beside them.

    On the local engine the ranks share this machine: a rank computes while up to
    min(ranks, cores) − 1 others compute on the other cores, and shares memory bandwidth
    and caches with them (measured here: the same forward + backward 2-20% slower with a
    second one running). So the profile is timed with that many co-runners: processes
    training the job's model on B/n rows in a loop. Elsewhere (YARN) nothing is started."""
    spec = job.training
    n = sum(g.instances for g in job.groups)
    count = min(n, os.cpu_count() or 1) - 1 if job.backend == "local" else 0
    if count <= 0:
        yield []
        return
    args = json.dumps({"model": spec.model, "shape": list(shape), "classes": classes,
                       "options": dict(spec.model_options), "rows": max(1, spec.batch_size // n)})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", _CO_RUNNER, args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(count)]
    try:
        deadline, ready = time.monotonic() + timeout, []
        for p in procs:
            if select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0] \
                    and p.stdout.readline().strip() == "READY":
                ready.append(p)
        if len(ready) < len(procs):
            log.warning("planner: %d of %d co-runners did not start; measuring without them",
                        len(procs) - len(ready), len(procs))
        yield ready
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def plan_job(job, options=PlanOptions()):
    """The plan of a conf.JobSpec with a training section: a JSON-ready dict with the
    measured profiles and link, the prediction of every strategy for the job's own
    containers, the recommendation, and the simulated clusters."""
    spec = job.training
    if spec is None:
        raise PlanError("the job has no training section: the planner predicts the built-in runner's strategies")
    shape, classes, shape_from = _input_of(spec, options)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, shape, classes, spec.model_options)
    make_opt = _make_optimizer_for(spec)
    profiles = {}

    def profile_for(threads, device):
        key = (device, threads)
        if key not in profiles:
            profiles[key] = measure_profile(model, shape, spec.batch_size, make_opt, threads, device,
                                            min_time=options.min_time, min_reps=3)
        return profiles[key]

    link = _job_link(job, options)
    B = spec.batch_size
    with co_runners(job, shape, classes):
        devices = job_devices(job, profile_for, options.gpu_speed)
        ref = devices[0]
        names = conv_layers_of(ref.profile, spec.model_parallel.layers)
        # Time what the ranks will really run: their row counts and their kernel shares.
        rows = set()
        for shares in (spec.shares, "speed"):
            rows.update(split_rows(B, share_weights(devices, shares)))
        layer_split = _conv_split(devices, names, spec.model_parallel.split) if names else None
        idle = {}
        for key, prof in profiles.items():
            measure_rows(prof, model, shape, rows, min_time=options.min_time)
            if layer_split:
                measure_shares(prof, model, shape, layer_split, min_time=options.min_time)
            users = [d for d in devices if d.profile is prof]
            if any(d.quota < 1.0 for d in users) or (layer_split and len(devices) > 1):
                idle[key] = cold = idle_profile(prof)
                measure_rows(cold, model, shape, rows, min_time=options.min_time)
                if layer_split:
                    measure_shares(cold, model, shape, layer_split, min_time=options.min_time)
    by_id = {id(p): idle.get(k) for k, p in profiles.items()}
    devices = [dataclasses.replace(d, idle=by_id.get(id(d.profile))) for d in devices]
    sched = _job_scheduling(job, devices, options)
    ar = {"bucket_mb": spec.allreduce.bucket_mb, "ring_threshold_kb": spec.allreduce.ring_threshold_kb}
    own = options.strategy_cpu
    if own is None:
        own = measure_strategy_cpu(spec.model, spec.model_options, shape, classes, B, names) \
            if len(devices) > 1 else {}
    mine = own_cpu(own)
    preds = predict_all(devices, link, B, spec.shares, names, spec.model_parallel.split, sched, ar, mine)
    # The data-parallel strategies also with speed-proportional shares, for the recommendation.
    speed_preds = {"allreduce": predict_allreduce(devices, link, B, "speed", sched, **ar, own=mine["allreduce"]),
                   "ps_central": predict_central_ps(devices, link, B, "speed", sched, mine["ps_central"]),
                   "ps_sharded": predict_sharded_ps(devices, link, B, "speed", sched, mine["ps_sharded"])}
    candidates = [(p["step_s"], k, p, "the job's shares") for k, p in preds.items() if p]
    candidates += [(p["step_s"], k, p, "shares: speed") for k, p in speed_preds.items()]
    _, best, best_p, how = min(candidates, key=lambda c: c[0])
    if best == "conv_model_parallel":
        why = f"kernels per rank {best_p['split']}"
    else:
        why = f"rows per rank {best_p['split']} ({how})"
    f = conv_fraction(ref, names) if names else 0.0
    plan = {
        "job": job.name,
        "model": {"name": spec.model, "options": dict(spec.model_options), "input_shape": list(shape),
                  "input_from": shape_from, "classes": classes, "batch": B,
                  "params": ref.profile.params, "param_bytes": ref.profile.param_bytes,
                  "conv_layers": names, "conv_fraction": f},
        "link": link.as_dict(),
        "scheduling": dict(dataclasses.asdict(sched), strategy_cpu=own),
        "devices": [{"rank": r, "name": d.name, "speed": d.speed, "quota": d.quota, "vcores": d.vcores,
                     "threads": d.profile.threads, "device": d.profile.device,
                     "step_s": d.step_s} for r, d in enumerate(devices)],
        "profiles": [p.as_dict() for p in profiles.values()],
        "shares": spec.shares,
        "single_s": ref.step_s,
        "strategies": preds,
        "speed_shares": speed_preds,
        "recommended": {"strategy": best, "step_s": best_p["step_s"], "speedup": best_p["speedup"],
                        "split": best_p["split"], "why": why},
        "bound": preds["conv_model_parallel"]["bound"] if preds["conv_model_parallel"] else None,
        "scaling": simulate(ref, link.between_machines(), B, names, options, own),
        "volumes": _volumes(model, shape, [d.speed for d in devices], B),
    }
    return _rounded(plan)


def _volumes(model, shape, capacities, batch):
    """Communication volume and balance per method (training.partition; Eserol 2019):
    hypergraph partition, conv-layer split, pipeline, data parallelism. None (with the
    reason) for a model the partitioner cannot take, or a single rank."""
    if len(capacities) < 2:
        return {"note": "one rank: nothing to partition"}
    from .partition import PartitionError, partition_report
    try:
        return {"rows": partition_report(model, shape, capacities, batch)}
    except PartitionError as e:
        return {"note": f"no volume report: {e}"}


def simulate(ref, link, batch, names, options, own=None):
    """Predictions for clusters of m machines like `ref` (speed 1) for every m in
    options.machines and every bandwidth (options.bandwidths_bps, else the job's link),
    and, with options.gpu_speed, for one GPU (ref × gpu_speed, the master) plus m−1 CPUs
    (data-parallel shares and kernels proportional to speed)."""
    rates = options.bandwidths_bps or (link.bandwidth_bps,)
    latency = options.latency_s if options.latency_s is not None else link.latency_s
    kinds = [("cpu", None)] + ([("gpu+cpu", options.gpu_speed)] if options.gpu_speed else [])
    out = []
    for kind, gpu in kinds:
        for bps in rates:
            lk = Link(latency, bps / 8.0, link.source if bps == link.bandwidth_bps else "given")
            for m in options.machines:
                devs = [ref] * m
                if gpu:
                    devs = [dataclasses.replace(ref, name=f"gpu (x{gpu:g})", speed=ref.speed * gpu)] + [ref] * (m - 1)
                preds = predict_all(devs, lk, batch, "speed", names, None, own=own)
                out.append({"cluster": kind, "machines": m, "bandwidth_bps": bps,
                            "strategies": {k: (None if p is None else {"step_s": p["step_s"], "speedup": p["speedup"]})
                                           for k, p in preds.items()},
                            "bound": preds["conv_model_parallel"]["bound"] if preds["conv_model_parallel"] else None})
    return out


# ----------------------------------------------------------------------------------------
# Presentation
# ----------------------------------------------------------------------------------------

def _rate(bps):
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _split_text(strategy, split):
    if split is None:
        return "-"
    if strategy == "conv_model_parallel":
        return "kernels " + " ".join(f"{k}:{'/'.join(map(str, v))}" for k, v in split.items())
    return "rows " + "/".join(map(str, split))


def _scheduling_text(sc):
    if not sc:
        return "cpus: each rank has its own cores"
    cores = f"the ranks share {sc['cores']} cores" if sc["cores"] else "each rank has its own cores"
    own = sc.get("strategy_cpu") or {}
    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f}"    # noqa: E731  (None: not measured)
    worker = ("; the strategies' own CPU per step, rank 0 / others: "
              + ", ".join(f"{k} {ms(v[0])}/{ms(v[1])} ms" for k, v in own.items())) if own else ""
    return (f"cpus: {cores}; CFS period {sc['period_s'] * 1e3:g} ms; a polite wait costs "
            f"{sc['wait_s'] * 1e3:.2f} ms of CPU + {100 * sc['wait_cpu']:.0f}% of one while it lasts + "
            f"{sc.get('byte_s', 0) * 1e12:.0f} us per MB it receives{worker}")


def format_table(plan):
    """The plan as text: the job's predictions, the recommendation, the simulated clusters."""
    m, lk = plan["model"], plan["link"]
    lines = [f"plan for job {plan['job']!r}: {m['name']}, batch {m['batch']}, {m['params']:,} parameters "
             f"({m['param_bytes'] / 2**20:.2f} MiB), input {'x'.join(map(str, m['input_shape']))} "
             f"({m['input_from']})",
             f"link: {_rate(lk['bandwidth_bps'])}, latency {lk['latency_s'] * 1e6:.1f} us ({lk['source']})",
             "ranks: " + "; ".join(f"{d['rank']} {d['name']} step {d['step_s'] * 1e3:.1f} ms" for d in plan["devices"]),
             _scheduling_text(plan.get("scheduling")),
             f"distributed convs {m['conv_layers']}: share of a step f = {m['conv_fraction']:.2f}; "
             f"rank 0 alone: {plan['single_s'] * 1e3:.1f} ms/step",
             "",
             f"{'strategy':21s} {'compute ms':>10s} {'comm ms':>9s} {'step ms':>9s} {'speedup':>8s}  split / notes"]
    for name in STRATEGIES:
        p = plan["strategies"].get(name)
        if p is None:
            lines.append(f"{name:21s} {'n/a':>10s}")
            continue
        note = _split_text(name, p["split"])
        if p.get("bounds"):
            note += f"; seed 4 before quotas {p['bounds'][0] * 1e3:.1f}..{p['bounds'][1] * 1e3:.1f} ms"
        if name == "conv_model_parallel":
            note += f"; bound S <= {p['bound']:.2f}"
        lines.append(f"{name:21s} {p['compute_s'] * 1e3:10.2f} {p['comm_s'] * 1e3:9.3f} {p['step_s'] * 1e3:9.2f} "
                     f"{p['speedup']:8.2f}  {note}")
    for name, p in plan["speed_shares"].items():
        lines.append(f"{name + ' (speed)':21s} {p['compute_s'] * 1e3:10.2f} {p['comm_s'] * 1e3:9.3f} "
                     f"{p['step_s'] * 1e3:9.2f} {p['speedup']:8.2f}  {_split_text(name, p['split'])}")
    vol = plan.get("volumes") or {}
    if vol.get("rows"):
        lines += ["", f"{'partition':14s} {'KB/sample':>10s} {'max rank KB':>11s} {'imbalance':>9s} "
                      f"{'vs data parallel':>16s}"]
        for row in vol["rows"]:
            lines.append(f"{row['method']:14s} {row['volume_bytes_per_sample'] / 1e3:10.1f} "
                         f"{row['max_rank_bytes_per_sample'] / 1e3:11.1f} {row['imbalance']:9.3f} "
                         f"{100 * row['reduction_vs_data_parallel']:+15.1f}%")
    elif vol.get("note"):
        lines += ["", vol["note"]]
    r = plan["recommended"]
    lines += ["", f"recommended: {r['strategy']} ({r['why']}): {r['step_s'] * 1e3:.2f} ms/step, "
                  f"speedup {r['speedup']:.2f}", ""]
    if plan["scaling"]:
        lines.append(f"{'cluster':8s} {'bandwidth':>11s} {'machines':>8s} " +
                     " ".join(f"{s[:12]:>12s}" for s in STRATEGIES) + f" {'bound':>6s}")
        for row in plan["scaling"]:
            cells = [f"{row['strategies'][s]['speedup']:12.2f}" if row["strategies"][s] else f"{'n/a':>12s}"
                     for s in STRATEGIES]
            bound = f"{row['bound']:6.2f}" if row["bound"] else f"{'-':>6s}"
            lines.append(f"{row['cluster']:8s} {_rate(row['bandwidth_bps']):>11s} {row['machines']:8d} "
                         + " ".join(cells) + " " + bound)
        lines.append("(speedup over one machine like rank 0's container; gpu+cpu: over the GPU alone)")
    return "\n".join(lines)


def write_png(plan, path):
    """Predicted speedup against the number of machines, per strategy and bandwidth (and the
    conv bound), one panel per simulated cluster kind; matplotlib's Agg canvas (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    kinds = list(dict.fromkeys(r["cluster"] for r in plan["scaling"]))
    if not kinds:
        raise PlanError("nothing to plot: no simulated clusters")
    fig = Figure(figsize=(6.5 * len(kinds), 4.8))
    FigureCanvasAgg(fig)
    colors = dict(zip(STRATEGIES, ("tab:blue", "tab:red", "tab:orange", "tab:green")))
    styles = ["-", "--", ":", "-."]
    for i, kind in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), i + 1)
        rows = [r for r in plan["scaling"] if r["cluster"] == kind]
        rates = list(dict.fromkeys(r["bandwidth_bps"] for r in rows))
        for j, bps in enumerate(rates):
            sel = sorted((r for r in rows if r["bandwidth_bps"] == bps), key=lambda r: r["machines"])
            for s in STRATEGIES:
                pts = [(r["machines"], r["strategies"][s]["speedup"]) for r in sel if r["strategies"][s]]
                if pts:
                    ax.plot(*zip(*pts), styles[j % len(styles)], color=colors[s], marker="o", markersize=3,
                            label=f"{s} @ {_rate(bps)}")
        bound = sorted({(r["machines"], r["bound"]) for r in rows if r["bound"]})
        if bound:
            ax.plot(*zip(*bound), color="gray", linewidth=1, label="conv bound 1/((1-f)+f/k)")
        ms = sorted({r["machines"] for r in rows})
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("machines")
        ax.set_ylabel("predicted speedup")
        ax.set_title(f"{plan['model']['name']}, batch {plan['model']['batch']}: {kind}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_json(plan, path):
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    return path
