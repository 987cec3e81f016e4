"""Each rank's rows of every global batch, for your own loop (training.dist's names):
`share_weights` (equal, by vcores, by measured speed, or given), `split_rows`,
`permutation` (an epoch's order from the seed alone) and `ShareSampler`, the batch sampler
whose `weight` makes DistributedOptimizer's sum the global batch's gradient.
"""
import math

import numpy as np
import torch

from . import stalls


def _context():
    from .dist import context
    return context()


def split_rows(total, weights):
    """Integers n_r >= 0 with sum n_r = total and n_r ~ total * w_r / sum(w) (largest
    remainder, ties to the lower rank): every rank computes the same split."""
    from .data.order import split_rows as split
    return split(total, weights)


def share_weights(shares="equal", ctx=None, model=None, example=None, batch=None):
    """One weight per rank: "equal", "vcores" (each rank's container), "speed" (measured
    on every rank now: rows/s of forward + backward of `model` on `example`, a batch of
    inputs on the rank's device, then on the rank's share of a global batch of `batch`
    rows, by default the example's rows times the world's size;
    training.strategies.shares), or a list of numbers."""
    from .data.order import given_weights
    ctx = ctx or _context()
    if isinstance(shares, (list, tuple)) and (len(shares) != ctx.world_size or not all(float(w) > 0 for w in shares)):
        raise ValueError(f"shares: expected {ctx.world_size} positive weights, got {list(shares)}")
    given = given_weights(shares, [r.vcores for r in ctx.ranks])
    if given is not None:
        return given
    if model is None or example is None:
        raise ValueError("shares 'speed' needs model= and example= (a batch of inputs) to measure")
    from .strategies.shares import measured_weights
    with stalls.collective(ctx, "share_weights") as comm:
        weights, _ = measured_weights(comm, model, example, batch or len(example) * ctx.world_size)
    return weights


def permutation(n, seed, epoch):
    """The order in which `epoch` visits n rows: numpy's PCG64 seeded with (seed, epoch),
    the same on every rank (and the order the built-in runner's loader uses)."""
    from .data.order import map_permutation
    return map_permutation(n, seed, epoch)


class ShareSampler(torch.utils.data.Sampler):
    """A batch sampler: this rank's rows of every global batch of a map-style dataset.

    Every epoch visits the dataset in an order drawn from (seed, epoch) alone (or in
    index order with shuffle=False), cut into global batches of `batch_size` rows; rank
    r gets rows [lo_r, hi_r) of each, n_r = hi_r - lo_r by `shares`. The slices of all
    ranks concatenate to the global batch, so the data seen does not depend on the
    world size or the shares. Use it as `DataLoader(dataset, batch_sampler=sampler)`.

    drop_last=True (the default) drops the last incomplete batch, so every step has
    exactly B rows and `weight` = n_r / B is exact for every step (with drop_last=False it
    is kept, unless it would leave a rank no rows). `start_step` skips
    the first steps of the first epoch iterated (resuming mid-epoch).
    """

    def __init__(self, dataset, batch_size, shares="equal", seed=0, shuffle=True, drop_last=True,
                 ctx=None, model=None, example=None):
        self.ctx = ctx or _context()
        self.n = dataset if isinstance(dataset, int) else len(dataset)
        self.batch_size = int(batch_size)
        if not 1 <= self.batch_size <= self.n:
            raise ValueError(f"batch_size {batch_size} must be between 1 and the dataset's {self.n} rows")
        self.weights = share_weights(shares, self.ctx, model, example, self.batch_size)
        counts = split_rows(self.batch_size, self.weights)
        if 0 in counts:         # a rank with no rows has no loss to backpropagate (DataLoader's collate fails)
            enough = math.ceil(sum(self.weights) / min(self.weights))   # from there every rank's floor is >= 1
            raise ValueError(f"batch_size {self.batch_size} leaves rank(s) "
                             f"{', '.join(str(r) for r, c in enumerate(counts) if not c)} without rows of a batch "
                             f"(shares {[round(w, 3) for w in self.weights]}); "
                             + (f"give a batch_size of {enough} or more" if enough <= self.n else "use fewer ranks"))
        self._bounds = np.cumsum([0] + list(counts))        # every rank's [lo, hi) of a full batch
        self.lo, self.hi = int(self._bounds[self.ctx.rank]), int(self._bounds[self.ctx.rank + 1])
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.epoch = 0
        self.start_step = 0

    @property
    def rows(self):
        """n_r: this rank's rows of a full global batch."""
        return self.hi - self.lo

    @property
    def weight(self):
        """w_r = n_r / B, the weight of this rank's gradient (DistributedOptimizer)."""
        return self.rows / self.batch_size

    def set_epoch(self, epoch, start_step=0):
        self.epoch, self.start_step = int(epoch), int(start_step)

    def __len__(self):
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last and self._every_rank_has_rows(rest) else 0)

    def _every_rank_has_rows(self, size):
        """Whether a last, partial batch of `size` rows gives every rank some (the same answer
        on every rank): one that would leave a rank none is dropped, as with drop_last, since
        that rank has no loss to backpropagate."""
        cut = self._bounds * size // self.batch_size
        return bool((np.diff(cut) > 0).all())

    def __iter__(self):
        order = permutation(self.n, self.seed, self.epoch) if self.shuffle else np.arange(self.n)
        for step in range(self.start_step, len(self)):
            start = step * self.batch_size
            size = min(self.batch_size, self.n - start)
            lo, hi = self.lo * size // self.batch_size, self.hi * size // self.batch_size
            yield order[start + lo:start + hi].tolist()
        self.start_step = 0
