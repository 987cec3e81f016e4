"""The cost model of ring all-reduce, and the data-parallel step every data-parallel
strategy shares (the parameter servers' cost models use it too).

Notation: n ranks (rank 0 first), g_r = t_r(n_r) + u_r the compute of rank r's share
of n_r rows (split as the strategies split them, training.strategies.shares) plus the
strategy's own CPU u_r (its hooks, copies, MPI calls: measured by the planner's
strategy probe), g = max_r g_r (the slowest share), o_r rank r's optimizer step,
α + m/β the link's one-way time of m bytes, |W| the parameter bytes.

    ring all-reduce  T = g + max_r o_r + 2(n−1)/n·|W|/β + 2(n−1)α          (+ 2⌈log2 n⌉α
                     for the two small all-reduces of rows and loss in every step)
    on one host      the ring's term is max(1, n/2)·|W|/β_shm + 2α instead, where β_shm is
                     the shared-memory all-reduce's measured algorithm bandwidth for two
                     ranks (link.shared_Bps; each rank reads and writes |W|, so n ranks
                     share the memory's bandwidth n/2 times as many ways)

played out under the ranks' CPU quotas and shared cores (training.perf.quota_sim: the
phases compute | exchange | optimizer, each ended by a synchronisation); without
either it is the formula ("formula_s"). Not modelled: the overlap of the buckets'
reductions with backward (the ring's time is added after compute).
"""
import dataclasses
import math

from training.collectives.shm import THRESHOLD_BYTES
from training.perf.formulas import log2
from training.perf.model import per_rank, prediction, share_weights
from training.strategies.shares import split_rows


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What a data-parallel strategy does between backward and the next step: `seconds`
    of communication (without the two small all-reduces of every step), the fraction of
    the optimizer step each rank runs, how many waits a rank makes, and the bytes each
    rank receives (a polite rank copies them inside its waits)."""
    seconds: float
    optimizer: list
    waits: int
    received: list


def data_parallel(strategy, case, exchange, bounds=None):
    """The step of a data-parallel strategy on case.devices: every rank computes its rows
    (plus the strategy's own CPU), then `exchange`, then its part of the optimizer.
    bounds(g) -> (best, worst) seconds of the formula's other cases, reported as
    "bounds" (plus the optimizer)."""
    devices, link, sched = case.devices, case.link, case.sched
    n = len(devices)
    rows = split_rows(case.batch, share_weights(devices, case.shares))
    lg, a = log2(n), link.latency_s
    mine = per_rank(case.own_cpu(strategy), n)
    rank_s = [d.fwd_bwd_s(r) + o / d.quota for d, r, o in zip(devices, rows, mine)]
    g = max(rank_s)                                             # the slowest share
    opt_part = exchange.optimizer
    opt = max(d.optimizer_s(f) for d, f in zip(devices, opt_part) if f)
    comm = exchange.seconds + 2 * lg * a if n > 1 else 0.0
    # compute, the exchange (every rank waits for it), the optimizer, the next step's
    # row count all-reduce (a barrier); a rank's waits in a step: the row count and the
    # loss all-reduces, and the exchange's
    got = exchange.received if n > 1 else [0.0]
    copies = [b * sched.byte_s if d.quota < 1.0 else 0.0 for d, b in zip(devices, got)]
    step = sched.step_s(devices, [[d.fwd_bwd_s(r, full=True) + o + c
                                   for d, r, o, c in zip(devices, rows, mine, copies)],
                                  [d.optimizer_s(f, full=True) for d, f in zip(devices, opt_part)]],
                        [comm, 0.0], [2 + exchange.waits if n > 1 else 0, 0])
    extra = {"rank_s": rank_s, "formula_s": g + opt + comm}
    if bounds is not None and n > 1:
        best, worst = bounds(g)
        extra["bounds"] = [best + opt, worst + opt]
    return prediction(strategy, devices, step, step - comm, comm, rows, **extra)


def predict(case, config):
    """Ring all-reduce (module docstring); config: the strategy's conf block, whose
    bucket_mb and ring_threshold_kb give the waits per step (each bucket's ring
    exchanges, or one MPI_Allreduce)."""
    n, w = len(case.devices), case.devices[0].profile.param_bytes
    a, bw = case.link.latency_s, case.link.bandwidth_Bps
    buckets = max(1, math.ceil(w / (config.bucket_mb * 2**20)))
    large = w / buckets >= config.ring_threshold_kb * 1024
    shared = case.link.shared_Bps if getattr(config, "shared_memory", False) else None
    if shared and w / buckets >= min(config.ring_threshold_kb * 1024, THRESHOLD_BYTES):
        return data_parallel("allreduce", case, Exchange(seconds=max(1.0, n / 2) * w / shared + 2 * a,
                                                         optimizer=[1.0] * n, waits=2 * buckets,
                                                         received=[w] * n))
    waits = buckets * (2 * (n - 1) if large else 1)
    return data_parallel("allreduce", case, Exchange(seconds=2 * (n - 1) / n * w / bw + 2 * (n - 1) * a,
                                                     optimizer=[1.0] * n, waits=waits,
                                                     received=[2 * (n - 1) / n * w] * n))
