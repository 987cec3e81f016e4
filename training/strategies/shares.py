"""Each rank's share of a global batch, for the data-parallel strategies (and
training.dist, the Horovod-style API): rows split in proportion to weights, and the
speed that 'speed' shares are proportional to.

`training.shares` gives the weights: equal, the ranks' vcores, their measured speed
(`measure_speed`, rows per second of forward + backward), or one weight per rank.
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
    """Rows per second of forward + backward on `example` (a batch of inputs): the rows of
    every timed pass over their whole time, `passes` at least and `min_time` seconds at least.

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
        once()                                      # warm-up: allocator, kernel selection
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
    return len(example) * reps / elapsed


def costly_ranks(speeds, batch, ring_s):
    """The ranks that give less than they cost, with speed-proportional shares: those
    without which the step would be faster. speeds: rows/s of each rank (measure_speed);
    batch: the global batch; ring_s: seconds of one all-reduce of the gradient over all
    n ranks (a ring's time goes as 2(n-1)/n, so without one rank it is
    ring_s * (n-2)n / (n-1)^2). Returns [(rank, share of the batch, step seconds with
    it, predicted step seconds without it)], compute balanced in both cases."""
    n, total = len(speeds), float(sum(speeds))
    if n < 2:
        return []
    with_s = batch / total + ring_s
    ring_without = ring_s * (n - 2) * n / (n - 1) ** 2
    out = []
    for r, s in enumerate(speeds):
        without_s = batch / (total - s) + ring_without
        if without_s < with_s:
            out.append((r, s / total, with_s, without_s))
    return out
