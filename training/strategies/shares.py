"""Each rank's share of a global batch, for the data-parallel strategies (and
training.dist, the Horovod-style API): rows split in proportion to weights, and the
speed that 'speed' shares are proportional to.

`training.shares` gives the weights: equal, the ranks' vcores, their measured speed
(`measure_speed`, rows per second of forward + backward), or one weight per rank.
"""
import time

import numpy as np
import torch

SPEED_PROBE_ROWS = 16     # rows of the timed forward/backward passes behind shares: speed
SPEED_PROBE_PASSES = 2    # timed passes (after one warm-up); the fastest counts


def split_rows(total, weights):
    """Integers n_r >= 0 with sum n_r = total and n_r ~ total * w_r / sum(w).

    Largest remainder: floors first, then one more row to the largest remainders
    (ties to the lower rank). Deterministic, so every rank computes the same split.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(w > 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"shares must be positive finite weights, got {list(weights)}")
    exact = total * w / w.sum()
    rows = np.floor(exact).astype(np.int64)
    left = int(total - rows.sum())
    order = sorted(range(len(w)), key=lambda r: (-(exact[r] - rows[r]), r))
    for r in order[:left]:
        rows[r] += 1
    return [int(n) for n in rows]


def measure_speed(model, example, passes=SPEED_PROBE_PASSES):
    """Rows per second of forward + backward on `example` (a batch of inputs).

    Leaves the model as it found it: parameters, gradients, buffers (BatchNorm
    statistics) and the torch random state are restored afterwards.
    """
    buffers = [b.detach().clone() for b in model.buffers()]
    grads = [p.grad for p in model.parameters()]
    rng = torch.get_rng_state()
    was_training = model.training
    model.train()
    best = float("inf")
    try:
        for i in range(passes + 1):
            t = time.perf_counter()
            out = model(example)
            out.float().sum().backward()
            dt = time.perf_counter() - t
            if i:                                   # the first pass warms up
                best = min(best, dt)
            for p in model.parameters():
                p.grad = None
    finally:
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        torch.set_rng_state(rng)
        model.train(was_training)
    return len(example) / best
