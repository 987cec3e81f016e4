"""Each rank's share of a global batch, for the data-parallel strategies (and
training.dist, the Horovod-style API): rows split in proportion to weights, and the
weights that 'speed' shares measure.

`training.shares` gives the weights: equal, the ranks' vcores, their measured speed, or
one weight per rank. A rank's speed depends on how many rows it is timed on: a GPU's
pass is mostly kernel launches at a few rows, a CPU's is not. So every rank times a pass
twice (`measured_weights`): on SPEED_PROBE_ROWS rows, then on the rows that the first
timings give it, and its weight is its speed on those, its own share. Timed once on 16
rows, an H200 beside two 4-vcore CPU ranks was weighed at a fraction of its speed on its
real share, and the CPUs got ~10x their rows (the step 0.19x the GPU alone's).
"""
import time

import torch

from training.data.order import split_rows   # noqa: F401  (its home: the data order)
from training.devices import synchronize

SPEED_PROBE_ROWS = 16     # rows of the timed forward/backward passes behind shares: speed
SPEED_PROBE_PASSES = 2    # timed passes at least (after one warm-up)
SPEED_PROBE_S = 0.3       # ... and at least this long: three CFS periods (100 ms), so that a
                          # container's CPU quota shows (a pass shorter than its quota's share
                          # of a period runs at the full core's speed)


def measure_speed(model, example, passes=SPEED_PROBE_PASSES, min_time=SPEED_PROBE_S):
    """Rows per second of forward + backward on `example` (a batch of inputs): its rows
    over pass_seconds."""
    return len(example) / pass_seconds(model, example, passes, min_time)


def pass_seconds(model, example, passes=SPEED_PROBE_PASSES, min_time=SPEED_PROBE_S, warmup=True):
    """Seconds of one forward + backward on `example` (a batch of inputs): the mean of
    the timed passes, `passes` at least and `min_time` seconds at least, after one
    untimed pass (`warmup`).

    On the device `example` is on (a GPU rank's is timed with its queue drained), so
    shares: speed weighs a GPU rank against CPU ranks on real rows. Leaves the model as it
    found it: parameters, gradients, buffers (BatchNorm statistics) and the torch random
    state are restored afterwards.
    """
    buffers = [b.detach().clone() for b in model.buffers()]
    grads = [p.grad for p in model.parameters()]
    rng = torch.get_rng_state()
    was_training = model.training
    model.train()
    def once():
        model(example).float().sum().backward()
        for p in model.parameters():
            p.grad = None

    try:
        if warmup:
            once()                                  # warm-up: allocator, kernel selection
        synchronize(example.device)                 # a GPU's queued work is not the probe's
        reps, t0 = 0, time.perf_counter()
        while reps < passes or time.perf_counter() - t0 < min_time:
            once()
            reps += 1
            synchronize(example.device)
        elapsed = time.perf_counter() - t0
    finally:
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        torch.set_rng_state(rng)
        model.train(was_training)
    return elapsed / reps


def rows_of(example, rows):
    """`example` cut or repeated to `rows` rows."""
    if len(example) >= rows:
        return example[:rows]
    reps = -(-rows // len(example))
    return example.repeat(reps, *([1] * (example.dim() - 1)))[:rows]


def fit_line(p1, t1, p2, t2):
    """(a, s) of t(n) = a + n / s, the pass time of n rows, through the timed points
    (p1, t1) and (p2, t2) (rows, seconds); (p2, t2) is the rank's own share, where the
    line must hold best. Timing noise that makes the line fall or start below zero is
    clipped: the per-row cost is at least 5% of the mean's, and a >= 0."""
    if p1 == p2:
        return 0.0, p2 / t2
    per_row = (t2 - t1) / (p2 - p1)
    per_row = max(per_row, 0.05 * min(t1 / p1, t2 / p2))
    return max(0.0, t2 - per_row * p2), 1.0 / per_row


def second_rows(batch, probe_rows, first_s):
    """Every rank's rows in the second timing: its share of `batch` by the first timing's
    speeds (probe_rows / first_s[r]), at least 2 (training-mode BatchNorm after a
    flatten refuses a batch of one)."""
    return [max(2, n) for n in split_rows(batch, [probe_rows / t for t in first_s])]


def speed_weights(probe_rows, first_s, rows, second_s):
    """shares 'speed' from the two timings of every rank: (one weight per rank, the
    fits). A weight is the rank's speed on its own share's rows (rows[r] / second_s[r]),
    so a split whose passes already take equally long is kept, and one that is not moves
    rows towards the ranks that finished early, without extrapolating. The fits
    (fit_line) are for costly_ranks."""
    fits = [fit_line(probe_rows, t1, p2, t2) for t1, p2, t2 in zip(first_s, rows, second_s)]
    return [p2 / t2 for p2, t2 in zip(rows, second_s)], fits


def measured_weights(comm, model, example, batch):
    """shares 'speed', measured now on every rank of `comm` (collective): (weights, fits).
    `example`: this rank's batch of inputs, on its device. A world of one times nothing.
    The second timing is one pass (and SPEED_PROBE_S at least), after a warm-up on a GPU
    only (cuDNN picks its kernels per shape): a CPU rank's share of a large model's batch
    is a long pass, about one step's compute."""
    if comm.Get_size() == 1:
        return [1.0], [(0.0, 1.0)]
    first = pass_seconds(model, example)
    firsts = comm.allgather(first)
    rows = second_rows(batch, len(example), firsts)
    mine = rows[comm.Get_rank()]
    second = first if mine == len(example) else \
        pass_seconds(model, rows_of(example, mine), passes=1, warmup=example.device.type != "cpu")
    return speed_weights(len(example), firsts, rows, comm.allgather(second))


def costly_ranks(fits, batch, ring_s, weights=None):
    """The ranks that give less than they cost: those without which the step would be
    faster. fits: each rank's pass time t_r(n) = a_r + n / s_r as (a_r, s_r) (fit_line),
    or its rows/s alone (a_r = 0); weights: the shares (default: the s_r); batch: the
    global batch; ring_s: seconds of one all-reduce of the gradient over all n ranks (a
    ring's time goes as 2(n-1)/n, so without one rank it is ring_s * (n-2)n / (n-1)^2).
    Returns [(rank, share of the batch, step seconds with it, predicted step seconds
    without it)]: the slowest pass of the split by the weights, with and without it."""
    fits = [(0.0, float(f)) if isinstance(f, (int, float)) else f for f in fits]
    n = len(fits)
    if n < 2:
        return []
    weights = [s for _, s in fits] if weights is None else weights

    def step_s(ranks):
        total = sum(weights[r] for r in ranks)
        return max(fits[r][0] + batch * weights[r] / total / fits[r][1] for r in ranks)

    with_s = step_s(range(n)) + ring_s
    ring_without = ring_s * (n - 2) * n / (n - 1) ** 2
    out = []
    for r in range(n):
        without_s = step_s([q for q in range(n) if q != r]) + ring_without
        if without_s < with_s:
            out.append((r, weights[r] / sum(weights), with_s, without_s))
    return out
