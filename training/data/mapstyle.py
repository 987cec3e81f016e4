"""A user's map-style dataset (`training.data.dataset: package.module:factory`) as a
source of the runner, with the same order, shares and exact resume as Parquet data.

The factory is called with `training.data.dataset_options` (nested values allowed),
plus `split="train"` / `"test"` when it takes `split` by name; it returns any object
with __len__ and __getitem__(i) -> (x, y) (a torch Dataset): x a tensor or array (the
model's input), y an integer class. With no `split` parameter, or when it returns None
for "test", there is no test set.

Epoch e visits the rows in map_permutation(n, seed, e) (training.data.order), cut
into global batches; this rank reads rows [lo, hi) of each. Items are fetched in the
consumer's thread, each with torch's, numpy's and Python's global generators seeded
from (seed, epoch, index) and restored after, so random augmentation inside
__getitem__ is the same in a resumed run (and does not disturb the model's draws).
"""
import random
import time

import numpy as np

from .common import DataError
from .order import Order, Schedule
from .source import _Batches, _seed_of


class MapSource:
    def __init__(self, ref, options, split, ctx=None, dataset=None):
        from training import userfn
        self.ref, self.split = ref, split
        if dataset is None:
            fn = userfn.load(ref, "training.data.dataset")
            offered = {"split": split}
            dataset = userfn.call(fn, options, "training.data.dataset", offered=offered)
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise DataError(f"training.data.dataset: {ref} returned a {type(dataset).__name__}, not a map-style "
                            f"dataset (with __len__ and __getitem__)")
        self.dataset = dataset
        self.uri = ref
        if len(dataset) == 0:
            raise DataError(f"training.data.dataset: {ref} returned an empty dataset for split {split!r}")
        x, _ = self.item(0, 0, 0)
        self.shape = tuple(x.shape)
        self.num_classes = self._num_classes()
        self.classes = list(getattr(dataset, "classes", None) or range(self.num_classes))
        self.order = Order([len(dataset)], map_style=True)

    def __len__(self):
        return len(self.dataset)

    def __repr__(self):
        return f"MapSource({self.ref!r}, split={self.split!r}, rows={len(self)}, shape={self.shape})"

    def _num_classes(self):
        ds = self.dataset
        if getattr(ds, "num_classes", None):
            return int(ds.num_classes)
        if getattr(ds, "classes", None):
            return len(ds.classes)
        targets = getattr(ds, "targets", None)
        if targets is None:
            targets = [self.item(i, 0, 0)[1] for i in range(len(ds))]
        return int(np.max(np.asarray(targets))) + 1

    def item(self, i, seed, epoch):
        """(x tensor, y int) of row i, the global generators seeded from (seed, epoch, i)."""
        import torch

        s = _seed_of(seed, epoch, i)
        saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        torch.manual_seed(s)
        np.random.seed(s % 2 ** 32)
        random.seed(s)
        try:
            item = self.dataset[int(i)]
        finally:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])
        try:
            x, y = item[0], item[1]
        except (TypeError, IndexError, KeyError):
            raise DataError(f"training.data.dataset: item {i} of {self.ref} is a {type(item).__name__}, "
                            f"expected (x, y)") from None
        x = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
        if not x.is_floating_point():
            x = x.to(torch.float32)
        return x, int(y)

    def example(self, n=16):
        import torch
        return torch.stack([self.item(i, 0, 0)[0] for i in range(min(n, len(self)))])

    def batches(self, global_batch, lo, hi, seed, start_step=0, epochs=None, drop_last=True, train=True,
                prefetch=None):
        return MapBatches(self, global_batch, lo, hi, seed, start_step, epochs, drop_last, train)


class MapBatches(_Batches):
    """This rank's rows of every global batch of a MapSource, fetched on demand."""

    def __init__(self, src, global_batch, lo, hi, seed, start_step=0, epochs=None, drop_last=True, train=True):
        super().__init__(len(src), global_batch, lo, hi, start_step, epochs, drop_last, src.ref)
        self.src, self.seed = src, int(seed)
        self.schedule = Schedule(src.order, seed, self.global_batch, self.lo, self.hi, self.drop_last, shuffle=train)

    def __iter__(self):
        import torch

        g = self.start
        while self.end is None or g < self.end:
            t0 = time.perf_counter()
            epoch, step = divmod(g, self.steps_per_epoch)
            rows, _ = self.schedule.rows(g)
            items = [self.src.item(i, self.seed, epoch) for i in rows.tolist()]
            if items:
                x = torch.stack([it[0] for it in items])
            else:
                x = torch.zeros((0,) + tuple(self.src.shape))
            y = torch.tensor([it[1] for it in items], dtype=torch.int64)
            bad = (y < 0) | (y >= self.src.num_classes)
            if bool(bad.any()):
                raise DataError(f"training.data.dataset: row {int(rows[bad.numpy()][0])} has label "
                                f"{int(y[bad][0])}, outside [0, {self.src.num_classes})")
            dt = time.perf_counter() - t0
            self._stats.wait_s += dt
            self._stats.decode_s += dt
            self._stats.batches += 1
            self._stats.samples += len(y)
            yield epoch, step, x, y
            g += 1

    def close(self):
        pass

