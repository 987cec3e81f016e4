"""Image datasets: Parquet on any pyarrow filesystem URI, streamed per rank, or a user's
map-style dataset; importers that write Parquet; the order every rank agrees on.

    from training.data import open_dataset
    train = open_dataset(job.training.data, "train", ctx)       # shape, num_classes, len
    for epoch, step, x, y in train.batches(B, lo, hi, seed=0): ...

One concern per module:
    formats    what a Parquet dataset holds (footers): columns, image kind, classes, blocks
    writer     writing datasets atomically;  importers  `yarnapp data import` kinds
    order      the global order (pure functions of seed and epoch) and each rank's share
    reader     reading blocks ahead within a byte budget;  decode  bytes -> pixels
    transforms augmentation and normalisation, deterministic per (seed, epoch, row)
    stats      mean/std: given, from metadata, cached or computed
    source     a Parquet dataset's batches (decoding workers);  mapstyle  a user's dataset
docs/data.md describes the formats, the shuffle and its guarantees, and the memory bound.

Importing this package imports only numpy and pyarrow (the CLI imports it); torch,
Pillow, simplejpeg and scikit-learn are imported where they are used.
"""
from .common import DataError
from .importers import (IMPORT_KINDS, encode_images, import_arrays, import_digits, import_image_folder,
                        import_synthetic_cifar, run_import)
from .order import Order, map_permutation, split_rows, steps_per_epoch
from .source import LoaderStats, ParquetSource
from .writer import meta, write_dataset, write_encoded

__all__ = ["DataError", "IMPORT_KINDS", "LoaderStats", "MapSource", "Order", "ParquetSource", "encode_images",
           "import_arrays", "import_digits", "import_image_folder", "import_synthetic_cifar", "map_permutation",
           "meta", "open_dataset", "read_arrays", "run_import", "split_rows", "steps_per_epoch", "write_dataset",
           "write_encoded"]


def open_dataset(spec, split="train", ctx=None, reference=None):
    """The `split` ("train" or "test") of conf's training.data `spec`: a ParquetSource, a
    MapSource (spec.dataset), or None when the job has no such split.

    ctx (a RunContext): container memory and vcores for the defaults of the memory budget
    and the workers; with it, mean/std are resolved now, collectively (rank 0 computes
    them when needed, every rank must call). reference: the training set, whose classes
    and mean/std a test set uses.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if getattr(spec, "dataset", None):
        from training import userfn
        from .mapstyle import MapSource
        if split == "test":
            fn = userfn.load(spec.dataset, "training.data.dataset")
            if not userfn.accepts(fn, "split"):
                return None
            ds = userfn.call(fn, spec.dataset_options, "training.data.dataset", offered={"split": split})
            return None if ds is None else MapSource(spec.dataset, spec.dataset_options, split, ctx, dataset=ds)
        return MapSource(spec.dataset, spec.dataset_options, split, ctx)
    uri = spec.train if split == "train" else spec.test
    if not uri:
        return None
    return ParquetSource(uri, spec, ctx, reference)


def read_arrays(uri, spec=None):
    """(uint8 images N x C x H x W, int64 labels) of a whole Parquet dataset, in row order:
    for small data (tests, notebooks)."""
    return ParquetSource(uri, spec).read_arrays()


def __getattr__(name):
    if name == "MapSource":
        from .mapstyle import MapSource
        return MapSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
