"""A training or test set as the runner sees it, and its batches.

    src = open_dataset(spec.data, "train", ctx)      # a ParquetSource or a MapSource
    src.shape, src.num_classes, len(src)             # (C, H, W) after the transforms
    it = src.batches(B, lo, hi, seed=s, start_step=g, epochs=E, drop_last=True, train=True)
    for epoch, step, x, y in it: ...                 # this rank's rows of every global batch
    it.steps_per_epoch, it.stats, it.close()
    src.example(16)                                  # model inputs for `shares: speed`

The order is training.data.order's (a pure function of seed, epoch and the shares);
`start_step` is a global step, so a resumed run starts exactly where the checkpoint
was taken. For Parquet data three kinds of threads work ahead of training: the reader
(blocks, within the memory budget: training.data.reader), one assembler (copies this
rank's rows of each step out of the blocks) and `workers` decoders (decode, augment,
normalise a step's rows; Pillow and simplejpeg release the GIL). At most `prefetch`
decoded steps wait. Hooks (torchvision ops, training.data.transform) run per image in
the consumer's thread, with torch's generator seeded per row and restored after.
"""
import concurrent.futures
import dataclasses
import logging
import math
import os
import queue
import threading
import time

import numpy as np

from conf.schema import DATA_MEMORY_FRACTION

from . import stats as stats_mod
from . import transforms
from .common import BadData, DataError
from .decode import channels_of, decode, gather
from .checks import check_test_classes
from .formats import RAW, Columns, inspect
from .order import Order, Schedule, steps_per_epoch
from .reader import BlockReader, Cancelled, _Files, read_block

log = logging.getLogger(__name__)

MEMORY_FRACTION = DATA_MEMORY_FRACTION     # training.data.memory: null = this much of the container's memory
OFFLINE_MEMORY = 512 << 20     # ... or this much outside a container
CHANNEL_PROBE = 64             # encoded images: colour where any of this many first ones is


@dataclasses.dataclass
class LoaderStats:
    """What one iterator measured since it was created."""
    batches: int = 0          # steps handed to the consumer
    samples: int = 0          # rows handed to the consumer
    wait_s: float = 0.0       # time the consumer was blocked waiting for a step
    decode_s: float = 0.0     # worker time decoding, augmenting and normalising
    hook_s: float = 0.0       # consumer time in per-image hooks
    blocks_read: int = 0
    rereads: int = 0
    bytes_read: int = 0       # compressed bytes read from the filesystem
    read_s: float = 0.0
    peak_bytes: int = 0       # most bytes of blocks in memory at once
    over_budget: int = 0      # steps that needed more than the memory budget

    @property
    def samples_per_s(self):
        """Decoding throughput: rows per second of worker time."""
        return self.samples / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self):
        return {**dataclasses.asdict(self), "samples_per_s": self.samples_per_s}


def _seed_of(seed, epoch, row):
    return int(transforms.uniforms(seed, epoch, [row], 1, stream=10_007)[0, 0] * 2 ** 53)


class _Hooks:
    """Per-image callables (torchvision ops, the user's hook) in the consumer's thread,
    each image with a numpy Generator and torch's global generator seeded from
    (seed, epoch, row); torch's state is restored afterwards."""

    def __init__(self, hooks, user, field):
        self.hooks, self.user, self.field = hooks, user, field

    def __bool__(self):
        return bool(self.hooks or self.user)

    def __call__(self, hwc, seed, epoch, rows, train):
        import torch

        state = torch.get_rng_state()
        out = []
        try:
            for img, row in zip(hwc, rows.tolist()):
                s = _seed_of(seed, epoch, row)
                torch.manual_seed(s)
                rng = np.random.default_rng(s)
                image = transforms.pil_of(img)
                for h in self.hooks:
                    image = h(image, rng)
                if self.user is not None:
                    image = self.user(image, rng, train)
                out.append(transforms.array_of(image, self.field))
        finally:
            torch.set_rng_state(state)
        return transforms.stack(out)


def _user_hook(ref):
    if not ref:
        return None
    from training import userfn
    fn = userfn.load(ref, "training.data.transform")
    kw = {k for k in ("rng", "train") if userfn.accepts(fn, k)}

    def call(image, rng, train):
        extra = {}
        if "rng" in kw:
            extra["rng"] = rng
        if "train" in kw:
            extra["train"] = train
        return fn(image, **extra)
    return call


def _budget(spec, ctx):
    memory = getattr(spec, "memory", None)
    if memory or ctx is not None:
        return data_budget(memory, ctx.me.memory_mib if ctx is not None else 0)
    return OFFLINE_MEMORY


def data_budget(memory_mib, container_mib):
    """Bytes of the memory bound: training.data.memory, else MEMORY_FRACTION of the container."""
    return int(memory_mib) << 20 if memory_mib else int(container_mib * MEMORY_FRACTION) << 20


def _workers(spec, ctx):
    if spec is not None and getattr(spec, "workers", None):
        return int(spec.workers)
    if ctx is not None:
        return max(1, math.ceil(ctx.me.vcores))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class ParquetSource:
    """A Parquet dataset (training.data.formats), streamed per rank."""

    def __init__(self, uri, spec=None, ctx=None, reference=None):
        self.uri, self.spec, self.ctx = uri, spec, ctx
        g = (lambda k, d=None: getattr(spec, k, d) if spec is not None else d)
        shape = g("shape")
        self.layout = inspect(uri, Columns.of(g("columns")), tuple(shape) if shape else None,
                              named=reference is not None)
        self.classes, self.num_classes = self.layout.classes, self.layout.num_classes
        if reference is not None:
            check_test_classes(uri, self.classes, self.num_classes, reference.uri, reference.classes,
                               reference.num_classes)
            self.classes, self.num_classes = reference.classes, reference.num_classes
        self.channels = self._channels(shape, reference)
        if reference is not None and self.channels != reference.channels:        # raw pixels: not converted
            raise DataError(f"{uri}: its images have {self.channels} channel(s), the training set's "
                            f"({reference.uri}) {reference.channels}; give a test set of the same kind of images")
        log.info("%s: %d channel(s)%s", uri, self.channels, "" if self.layout.kind == RAW or shape or reference
                 else " (from its metadata, as imported; training.data.shape [C, H, W] sets C)"
                 if self.layout.meta.get("channels") else
                 f" (from its first {CHANNEL_PROBE} images: 3 where any is colour; training.data.shape [C, H, W] "
                 f"sets C)")
        self.train_ops, train_hooks = transforms.build(g("augment", []), "training.data.augment")
        self.test_ops, test_hooks = transforms.build(g("test_transforms", []), "training.data.test_transforms")
        user = _user_hook(g("transform"))
        self.hooks = {True: _Hooks(train_hooks, user, "training.data.transform"),
                      False: _Hooks(test_hooks, user, "training.data.transform")}
        self.window = (int(g("shuffle_window", 0) or 0) << 20)
        self.order = Order([b.rows for b in self.layout.blocks], [b.nbytes for b in self.layout.blocks],
                           self.window, content=[b.read_bytes for b in self.layout.blocks])
        self.budget = _budget(spec, ctx)
        self.workers = _workers(spec, ctx)
        self.prefetch = int(g("prefetch", 4))
        self._given = (g("mean"), g("std"))
        self._reference = reference
        self.mean = self.std = None
        if ctx is not None or reference is not None:
            self._resolve_stats()
        self.shape = self._shape()
        if reference is not None and self.shape != reference.shape:
            raise DataError(f"{uri}: its images come out {list(self.shape)} for the model, the training set's "
                            f"({reference.uri}) {list(reference.shape)}; give images of one size, or resize them "
                            f"to one in training.data.test_transforms (and training.data.augment, where the "
                            f"training set's differ)")

    def __len__(self):
        return self.layout.rows

    def __repr__(self):
        return (f"ParquetSource({self.uri!r}, rows={len(self)}, {self.layout.kind}, shape={self.shape}, "
                f"classes={self.num_classes})")

    @property
    def nbytes(self):
        return self.layout.nbytes

    def _channels(self, shape, reference):
        """Raw pixels: their shape's. Encoded images are converted to: training.data.shape's
        C, else the training set's (a test set), else yarnapp's metadata's, else 1 where the
        first images are all greyscale, 3 where any is colour (before, the first image alone
        decided: one grey JPEG first made an RGB dataset train as greyscale)."""
        if self.layout.kind == RAW:
            return self.layout.shape[0]
        if shape:
            if shape[0] not in (1, 3):
                raise DataError(f"{self.uri}: training.data.shape {list(shape)}: encoded images are decoded to 1 "
                                f"(greyscale) or 3 (RGB) channels; give C 1 or 3")
            return int(shape[0])
        if reference is not None:
            return reference.channels
        if self.layout.meta.get("channels"):
            return int(self.layout.meta["channels"])
        data, _ = self._first_rows(CHANNEL_PROBE)
        return channels_of(data)

    def _first_rows(self, n):
        files = _Files(self.layout)
        try:
            out, labels = [], []
            for block in self.layout.blocks:
                data, _ = read_block(self.layout, files, block)
                imgs, labs = gather(data, np.arange(min(n - len(labels), block.rows)))
                out.extend(imgs if isinstance(imgs, list) else list(imgs))
                labels.extend(labs.tolist())
                if len(labels) >= n:
                    break
        finally:
            files.close()
        if isinstance(out[0], np.ndarray):
            out = np.stack(out)
        return out, np.asarray(labels, np.int64)

    def _resolve_stats(self):
        if self.mean is not None:
            return
        ref = self._reference
        given = self._given if self._given[0] is not None else (ref.mean, ref.std) if ref is not None else None
        comm = self.ctx.comm if self.ctx is not None else None
        self.mean, self.std = stats_mod.resolve(self.layout, self.channels, given, comm)

    def _pixels(self, images, rows, epoch, seed, train):
        """uint8 (n, H, W, C) of decoded rows after the batch ops (worker side)."""
        hwc = decode(images, self.layout.shape, self.channels, lambda i: self.layout.where(int(rows[i])))
        hwc = transforms.apply(self.train_ops if train else self.test_ops, hwc, seed, epoch, rows)
        expected = getattr(self, "_sizes", {}).get(train)      # (H, W) the first image came out (_shape)
        if expected and len(hwc) and hwc.shape[1:3] != expected:
            # (within a batch stack() finds them; a batch of one file's rows, each rank's of
            # another, went through a model built for the first's: trained on, or a torch error)
            raise DataError(f"{self.layout.where(int(rows[0]))}: its image comes out {hwc.shape[1]}x{hwc.shape[2]}, "
                            f"the dataset's first {expected[0]}x{expected[1]}, for which the model is built; bring "
                            f"them to one size in training.data.augment and training.data.test_transforms alike, "
                            f"e.g. {{resize: {{size: [{expected[0]}, {expected[1]}]}}}}")
        return hwc

    def _shape(self):
        images, _ = self._first_rows(1)
        rows = np.zeros(1, np.int64)
        shapes, self._sizes = {}, {}
        for train in (True, False):
            hwc = self._pixels(images, rows, 0, 0, train)
            self._sizes[train] = hwc.shape[1:3]
            if self.hooks[train]:
                hwc = self.hooks[train](hwc, 0, 0, rows, train)
            shapes[train] = (hwc.shape[3], hwc.shape[1], hwc.shape[2])
        if shapes[True] != shapes[False]:
            raise DataError(f"{self.uri}: training images come out {list(shapes[True])} (training.data.augment), "
                            f"untransformed ones {list(shapes[False])} (training.data.test_transforms); make them "
                            f"the same size: the model also sees images through test_transforms (evaluation, the "
                            f"speed probe, Run.model().predict), with or without a test set")
        return shapes[True]

    def example(self, n=16):
        """Model inputs (float32, n x C x H x W) of the first n rows, test transforms."""
        self._resolve_stats()
        images, _ = self._first_rows(n)
        rows = np.arange(len(images), dtype=np.int64)
        hwc = self._pixels(images, rows, 0, 0, False)
        if self.hooks[False]:
            hwc = self.hooks[False](hwc, 0, 0, rows, False)
        return transforms.normalise(hwc, self.mean, self.std)

    def read_arrays(self):
        """(uint8 images N x C x H x W, int64 labels) of the whole dataset in row order,
        test transforms applied: for small data (tests, notebooks), not for training."""
        it = ParquetBatches(self, len(self), 0, len(self), seed=0, start_step=0, epochs=1, drop_last=False,
                            train=False, raw=True)
        with it:
            parts = [(x, y) for _, _, x, y in it]
        return (np.concatenate([p[0] for p in parts]).transpose(0, 3, 1, 2),
                np.concatenate([p[1] for p in parts]))

    def batches(self, global_batch, lo, hi, seed, start_step=0, epochs=None, drop_last=True, train=True,
                prefetch=None):
        self._resolve_stats()
        return ParquetBatches(self, global_batch, lo, hi, seed, start_step, epochs, drop_last, train,
                              prefetch=self.prefetch if prefetch is None else prefetch)


_END = object()


class _Batches:
    """Common iteration: positions, the stop/close protocol, statistics."""

    def __init__(self, n, global_batch, lo, hi, start_step, epochs, drop_last, what):
        self.global_batch = int(global_batch)
        self.lo, self.hi = int(lo), int(hi)
        if self.global_batch < 1:
            raise ValueError(f"global batch must be at least 1, got {global_batch}")
        if not 0 <= self.lo <= self.hi <= self.global_batch:
            raise ValueError(f"batch slice [{lo}:{hi}) is not inside a global batch of {global_batch}")
        self.drop_last = bool(drop_last)
        self.steps_per_epoch = steps_per_epoch(n, self.global_batch, self.drop_last)
        if self.steps_per_epoch == 0:
            raise DataError(f"global batch {self.global_batch} is larger than the {n} rows of {what}; "
                            f"lower the batch size")
        self.start = int(start_step)
        self.end = None if epochs is None else int(epochs) * self.steps_per_epoch
        self._stats = LoaderStats()

    @property
    def stats(self):
        return dataclasses.replace(self._stats)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class ParquetBatches(_Batches):
    """This rank's rows of every global batch of a ParquetSource (see the module doc)."""

    def __init__(self, src, global_batch, lo, hi, seed, start_step=0, epochs=None, drop_last=True, train=True,
                 prefetch=4, raw=False):
        super().__init__(len(src), global_batch, lo, hi, start_step, epochs, drop_last, src.uri)
        self.src, self.seed, self.train, self.raw = src, int(seed), bool(train), raw
        # the memory budget holds the decoded steps too (float32 and their uint8 pixels):
        # those waiting, the one being decoded and the one the consumer holds; they get
        # at most half of it, the blocks the rest
        step_bytes = max(1, self.hi - self.lo) * int(np.prod(src.shape)) * 5
        self.prefetch = max(1, min(int(prefetch), src.budget // 2 // step_bytes - 2))
        self.block_budget = max(src.budget - (self.prefetch + 2) * step_bytes, src.budget // 4)
        self.schedule = Schedule(src.order, seed, self.global_batch, self.lo, self.hi, self.drop_last, shuffle=train)
        self._threads = None
        self._lock = threading.Lock()

    def __iter__(self):
        self.close()
        reader = BlockReader(self.src.layout, self.schedule, self.start, self.end, self.block_budget)
        pool = concurrent.futures.ThreadPoolExecutor(self.src.workers, thread_name_prefix="yarnapp-decode")
        q = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        assembler = threading.Thread(target=self._assemble, args=(reader, pool, q, stop),
                                     name="yarnapp-assembler", daemon=True)
        self._threads = (reader, pool, q, stop, assembler)
        assembler.start()
        return self._consume(q)

    def _assemble(self, reader, pool, q, stop):
        def put(item):
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False
        try:
            g = self.start
            while (self.end is None or g < self.end) and not stop.is_set():
                rows, blocks = self.schedule.rows(g)
                data = reader.acquire(g)
                images, labels = self._gather(data, rows, blocks)
                reader.release(g)
                fut = pool.submit(self._process, g, rows, images, labels)
                if not put((g, rows, fut)):
                    return
                g += 1
            put(_END)
        except Cancelled:
            return
        except BaseException as e:  # handed to the consumer, which re-raises it
            put(e)

    def _gather(self, data, rows, blocks):
        starts = self.src.order.starts
        if len(rows) == 0:
            return [], np.zeros(0, np.int64)
        cuts = np.flatnonzero(np.diff(blocks)) + 1
        parts, labels = [], []
        for r, b in zip(np.split(rows, cuts), np.split(blocks, cuts)):
            imgs, labs = gather(data[int(b[0])], r - starts[int(b[0])])
            parts.append(imgs)
            labels.append(labs)
        if isinstance(parts[0], np.ndarray):
            return np.concatenate(parts), np.concatenate(labels)
        return [x for p in parts for x in p], np.concatenate(labels)

    def _process(self, g, rows, images, labels):
        t0 = time.perf_counter()
        src = self.src
        epoch = g // self.steps_per_epoch
        bad = (labels < 0) | (labels >= src.num_classes)
        if bad.any():
            raise BadData(f"{src.layout.where(int(rows[bad][0]))}: label {int(labels[bad][0])}, outside "
                          f"[0, {src.num_classes}) (the training set's classes)")
        if len(rows) == 0:
            hwc = np.zeros((0, src.shape[1], src.shape[2], src.shape[0]), np.uint8)
        else:
            hwc = src._pixels(images, rows, epoch, self.seed, self.train)
        out = hwc if (self.raw or src.hooks[self.train]) else transforms.normalise(hwc, src.mean, src.std)
        with self._lock:
            self._stats.decode_s += time.perf_counter() - t0
        return out, labels

    def _consume(self, q):
        import torch

        src = self.src
        hooks = src.hooks[self.train]
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                g, rows, fut = item
                x, y = fut.result()
                if hooks and not self.raw and len(rows):
                    t1 = time.perf_counter()
                    x = transforms.normalise(hooks(x, self.seed, g // self.steps_per_epoch, rows, self.train),
                                             src.mean, src.std)
                    self._stats.hook_s += time.perf_counter() - t1
                elif hooks and not self.raw:
                    x = transforms.normalise(x, src.mean, src.std)
                self._stats.wait_s += time.perf_counter() - t0
                self._stats.batches += 1
                self._stats.samples += len(y)
                e, s = divmod(g, self.steps_per_epoch)
                yield e, s, x, (y if self.raw else torch.from_numpy(y))
        finally:
            self.close()

    def close(self):
        """Stop the threads (iterating again starts over at start_step)."""
        threads, self._threads = self._threads, None
        if threads is None:
            return
        reader, pool, q, stop, assembler = threads
        stop.set()
        reader.cancel()
        while assembler.is_alive():
            try:
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
            assembler.join(timeout=0.05)
        pool.shutdown(wait=True, cancel_futures=True)
        reader.close()
        rs = reader.stats
        for k in ("blocks_read", "rereads", "bytes_read", "read_s", "peak_bytes", "over_budget"):
            setattr(self._stats, k, getattr(self._stats, k) + getattr(rs, k) if k != "peak_bytes"
                    else max(self._stats.peak_bytes, rs.peak_bytes))
