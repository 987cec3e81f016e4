"""Image datasets as Parquet shards on any pyarrow filesystem, and the batch loader.

On-disk format (one directory per dataset, written by the importers below):

    <uri>/part-00000.parquet, part-00001.parquet, ...
        image  fixed_size_binary(C*H*W)   uint8 pixels in C,H,W order
        label  int64                      0 <= label < num_classes
    schema metadata b"yarnapp" = JSON {"format": 1, "shape": [C, H, W],
        "num_classes": K, "classes": [names], "mean": [per channel], "std": [per channel]}

`mean`/`std` are in pixel units, measured on the training split; the loader hands
out ``(pixel - mean[c]) / std[c]`` as float32. Names starting with "." or "_" are
not shards (temporary directories, _SUCCESS markers).

A dataset appears atomically: it is written under a hidden sibling name
(`.<name>.tmp-<random>`) and renamed into place, so readers never see half of one.
Rename is atomic on local filesystems and HDFS; on object stores (s3://) a "move"
is a copy, so there a crash can leave a partial dataset behind.

This module imports only pyarrow and numpy at import time (the CLI imports it to
run `yarnapp data import`); torch is imported inside the functions that return
tensors, scikit-learn and Pillow inside the importers that need them.
"""
import dataclasses
import json
import logging
import os
import posixpath
import queue
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from conf.errors import YarnappError

log = logging.getLogger(__name__)

IMAGE = "image"
LABEL = "label"
META_KEY = b"yarnapp"
FORMAT = 1
_IMPORT_HINT = "import one with `yarnapp data import KIND URI`"


class DataError(YarnappError, ValueError):
    """A dataset that cannot be read or written. str() is one line naming the URI or file."""


# ----------------------------------------------------------------------------- filesystems

def _one_line(exc):
    """The first line of an exception's message (arrow errors can span a page)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _filesystem(uri):
    """(pyarrow filesystem, path inside it) for a URI or a plain local path."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    from . import fsutil
    try:
        return fsutil.resolve(uri)
    except (pa.ArrowException, OSError, ValueError) as e:
        hint = ("hdfs:// needs Java and libhdfs here (JAVA_HOME, HADOOP_HOME, CLASSPATH) and a reachable "
                "namenode" if uri.startswith(("hdfs://", "viewfs://")) else
                "check the scheme (file://, hdfs://, s3://) and that its filesystem is reachable from here")
        raise DataError(f"cannot open {uri}: {_one_line(e)}; {hint}") from None


def _join(uri, name):
    """`uri`/`name`, keeping a URI's query string (s3://b/x?region=r) at the end."""
    base, sep, query = uri.partition("?")
    return base.rstrip("/") + "/" + name + sep + query


def _info(fs, path, uri):
    try:
        return fs.get_file_info(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot reach {uri}: {_one_line(e)}; check the URI and that its "
                        f"filesystem is up") from None


# ----------------------------------------------------------------------------- writing

def _meta(shape, num_classes, classes, mean, std, source):
    return {"format": FORMAT, "shape": [int(s) for s in shape], "num_classes": int(num_classes),
            "classes": [str(c) for c in classes], "mean": [float(m) for m in mean],
            "std": [float(s) for s in std], "source": source}


def _channel_stats(images):
    """Per-channel mean and std (pixel units) of uint8 images (N, C, H, W), chunked."""
    n, c = images.shape[:2]
    total = np.zeros(c)
    total_sq = np.zeros(c)
    for i in range(0, n, 4096):
        chunk = images[i:i + 4096].astype(np.float64)
        total += chunk.sum(axis=(0, 2, 3))
        total_sq += np.square(chunk).sum(axis=(0, 2, 3))
    count = max(1, n * images.shape[2] * images.shape[3])
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean ** 2, 0.0))
    return mean, np.where(std > 1e-6, std, 1.0)


def _shard_table(images, labels, meta_bytes):
    n = len(images)
    width = int(np.prod(images.shape[1:]))
    pixels = np.ascontiguousarray(images, dtype=np.uint8).reshape(-1)
    image = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(pixels)])
    schema = pa.schema([(IMAGE, pa.binary(width)), (LABEL, pa.int64())], metadata={META_KEY: meta_bytes})
    return pa.Table.from_arrays([image, pa.array(labels, type=pa.int64())], schema=schema)


def _check_arrays(images, labels, num_classes, what):
    if images.ndim != 4:
        raise DataError(f"{what}: images must be (N, C, H, W) or (N, H, W), got shape {images.shape}")
    if len(images) != len(labels):
        raise DataError(f"{what}: {len(images)} images but {len(labels)} labels")
    if len(images) == 0:
        raise DataError(f"{what}: no images to write")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataError(f"{what}: labels must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")


def _check_absent(uri, overwrite):
    fs, path = _filesystem(uri)
    if not overwrite and _info(fs, path, uri).type != pafs.FileType.NotFound:
        raise DataError(f"{uri} already exists; delete it or import with overwrite")


def write_dataset(uri, images, labels, meta, shards=2, overwrite=False):
    """Write uint8 images (N, C, H, W) and int labels as one dataset at `uri`, atomically.

    `meta` is the schema metadata dict (see the module docstring; `_meta` builds it).
    Returns the dataset's summary dict.
    """
    images = np.asarray(images)
    labels = np.asarray(labels, dtype=np.int64)
    _check_arrays(images, labels, meta["num_classes"], uri)
    if images.dtype != np.uint8:
        raise DataError(f"{uri}: images must be uint8 pixels, got {images.dtype}")
    if list(images.shape[1:]) != meta["shape"]:
        raise DataError(f"{uri}: images have shape {images.shape[1:]}, metadata says {meta['shape']}")
    fs, path = _filesystem(uri)
    path = path.rstrip("/") or "/"
    parent, name = posixpath.split(path)
    exists = _info(fs, path, uri).type != pafs.FileType.NotFound
    if exists and not overwrite:
        raise DataError(f"{uri} already exists; delete it or import with overwrite")
    shards = max(1, min(int(shards), len(images)))
    bounds = np.linspace(0, len(images), shards + 1).round().astype(int)
    meta_bytes = json.dumps(meta).encode()
    tmp = posixpath.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        fs.create_dir(tmp, recursive=True)
        for i in range(shards):
            a, b = bounds[i], bounds[i + 1]
            table = _shard_table(images[a:b], labels[a:b], meta_bytes)
            with fs.open_output_stream(posixpath.join(tmp, f"part-{i:05d}.parquet")) as f:
                # pixels: no compression (read speed), no dictionary, no min/max statistics
                pq.write_table(table, f, compression="none", use_dictionary=[LABEL],
                               write_statistics=[LABEL], data_page_size=8 << 20)
        if exists:
            old = posixpath.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
            fs.move(path, old)
            fs.move(tmp, path)
            fs.delete_dir(old)
        else:
            fs.move(tmp, path)
    except (pa.ArrowException, OSError) as e:
        try:
            fs.delete_dir(tmp)
        except (pa.ArrowException, OSError):
            pass
        raise DataError(f"cannot write {uri}: {_one_line(e)}; check that its directory is "
                        f"writable") from None
    log.info("wrote %s: %d rows in %d shards, shape %s, %d classes",
             uri, len(images), shards, meta["shape"], meta["num_classes"])
    return {"uri": uri, "rows": int(len(images)), "shards": shards, "shape": meta["shape"],
            "num_classes": meta["num_classes"], "mean": meta["mean"], "std": meta["std"]}


def _stratified_split(labels, test_fraction, seed):
    """(train_idx, test_idx): `test_fraction` of every class held out, both shuffled."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


# ----------------------------------------------------------------------------- importers

DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 20240501


def import_digits(uri, shards=2, overwrite=False):
    """scikit-learn's bundled digits (1797 real 8x8 images, pixels 0..16) at `uri`/train
    and `uri`/test: a fixed stratified split holding out 20% of every class.

    The split is computed here from a fixed seed (not by scikit-learn's splitter), so
    it is the same on every run and every version.
    """
    from sklearn.datasets import load_digits

    train_uri, test_uri = _join(uri, "train"), _join(uri, "test")
    for u in (train_uri, test_uri):
        _check_absent(u, overwrite)
    digits = load_digits()
    images = digits.images.astype(np.uint8)[:, None, :, :]          # (1797, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    tr, te = _stratified_split(labels, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    mean, std = _channel_stats(images[tr])
    meta = _meta((1, 8, 8), 10, range(10), mean, std, "sklearn.datasets.load_digits")
    return {"kind": "digits", "datasets": [
        write_dataset(train_uri, images[tr], labels[tr], meta, shards, overwrite),
        write_dataset(test_uri, images[te], labels[te], meta, shards, overwrite)]}


def _synthetic_cifar_split(patterns, n, rng):
    """n images: class pattern (smooth, per channel) shifted by up to 3 pixels, plus noise."""
    labels = rng.permutation(np.arange(n) % len(patterns)).astype(np.int64)
    images = np.empty((n, 3, 32, 32), np.uint8)
    for i in range(0, n, 2048):
        y = labels[i:i + 2048]
        x = 128.0 + 8.0 * patterns[y] + rng.normal(0.0, 64.0, (len(y), 3, 32, 32))
        x += rng.normal(0.0, 12.0, (len(y), 1, 1, 1))                 # per-image brightness
        shift = rng.integers(-3, 4, (len(y), 2))
        for j in range(len(y)):
            x[j] = np.roll(x[j], tuple(shift[j]), axis=(1, 2))
        images[i:i + 2048] = np.clip(x, 0, 255).astype(np.uint8)
    return images, labels


def import_synthetic_cifar(uri, n_train=10000, n_test=2000, shards=4, seed=0, overwrite=False):
    """A learnable CIFAR-shaped stand-in (3x32x32 uint8, 10 balanced classes) at
    `uri`/train and `uri`/test.

    Each class has a smooth random colour pattern (4x4 per channel, upsampled); an
    image is 128 + 8 * its class pattern, randomly shifted by up to 3 pixels, plus a
    random brightness offset (std 12) and heavy per-pixel noise (std 64). Hard for a
    linear model (a nearest-class-mean classifier gets about 65% with 5000 training
    images), easy for a CNN. Same `seed`, same bytes.
    """
    train_uri, test_uri = _join(uri, "train"), _join(uri, "test")
    for u in (train_uri, test_uri):
        _check_absent(u, overwrite)
    rng = np.random.default_rng([seed % 2 ** 63, 0])
    coarse = rng.normal(0.0, 1.0, (10, 3, 4, 4))
    patterns = np.kron(coarse, np.ones((1, 1, 8, 8)))
    # smooth the 8x8 blocks a little so the patterns are not pure step functions
    patterns = (patterns + np.roll(patterns, 4, axis=2) + np.roll(patterns, 4, axis=3)) / 3.0
    x_train, y_train = _synthetic_cifar_split(patterns, int(n_train), np.random.default_rng([seed % 2 ** 63, 1]))
    x_test, y_test = _synthetic_cifar_split(patterns, int(n_test), np.random.default_rng([seed % 2 ** 63, 2]))
    mean, std = _channel_stats(x_train)
    meta = _meta((3, 32, 32), 10, range(10), mean, std, f"synthetic-cifar seed={seed}")
    return {"kind": "synthetic-cifar", "datasets": [
        write_dataset(train_uri, x_train, y_train, meta, shards, overwrite),
        write_dataset(test_uri, x_test, y_test, meta, shards, overwrite)]}


def import_arrays(uri, x, y, shards=2, num_classes=None, overwrite=False):
    """A user's arrays as one dataset at `uri`.

    x: uint8 (N, C, H, W), or (N, H, W) for one channel; y: integer labels. The
    number of classes is max(y) + 1 unless given; mean/std are measured on x.
    """
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim == 3:
        x = x[:, None]
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{uri}: labels must be integers, got {y.dtype}")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.integer) or x.size and (x.min() < 0 or x.max() > 255):
            raise DataError(f"{uri}: images must be uint8 pixels (0..255), got {x.dtype}; "
                            f"scale them to uint8 first")
        x = x.astype(np.uint8)
    num_classes = int(num_classes) if num_classes is not None else int(y.max()) + 1 if y.size else 0
    _check_arrays(x, y.astype(np.int64), num_classes, uri)
    mean, std = _channel_stats(x)
    meta = _meta(x.shape[1:], num_classes, range(num_classes), mean, std, "arrays")
    return {"kind": "arrays", "datasets": [write_dataset(uri, x, y, meta, shards, overwrite)]}


def import_image_folder(uri, folder, size=None, mode="RGB", shards=2, overwrite=False):
    """Images under `folder`/<class name>/* as one dataset at `uri` (Pillow reads them).

    Classes are the sorted subfolder names. `mode` is a Pillow mode ("RGB": 3
    channels, "L": 1). All images must have one size unless `size` = (H, W) resizes
    them. Labels are the class indices; the names go into the metadata.
    """
    from PIL import Image, UnidentifiedImageError

    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such folder; give a folder with one subfolder of images per class")
    if mode not in ("RGB", "L"):
        raise DataError(f"mode {mode!r}: choose RGB (3 channels) or L (1 channel)")
    if size is not None:
        size = (int(size), int(size)) if np.isscalar(size) else tuple(int(s) for s in size)
    _check_absent(uri, overwrite)
    extensions = {e.lower() for e in Image.registered_extensions()}
    classes = sorted(d for d in os.listdir(folder)
                     if os.path.isdir(os.path.join(folder, d)) and not d.startswith("."))
    images, labels = [], []
    for label, cls in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(folder, cls))):
            path = os.path.join(folder, cls, name)
            if name.startswith(".") or os.path.splitext(name)[1].lower() not in extensions:
                continue
            try:
                with Image.open(path) as im:
                    im = im.convert(mode)
                    if size is not None and im.size != (size[1], size[0]):
                        im = im.resize((size[1], size[0]), Image.BILINEAR)
                    arr = np.asarray(im, dtype=np.uint8)
            except (UnidentifiedImageError, OSError) as e:
                raise DataError(f"{path}: not a readable image ({_one_line(e)}); remove or replace it") from None
            arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
            if images and arr.shape != images[0].shape:
                raise DataError(f"{path}: image is {arr.shape[2]}x{arr.shape[1]}, others are "
                                f"{images[0].shape[2]}x{images[0].shape[1]}; pass size=(H, W) to resize")
            images.append(arr)
            labels.append(label)
    if not images:
        raise DataError(f"{folder}: no images found; expected {folder}/<class>/<image files>")
    x = np.stack(images)
    mean, std = _channel_stats(x)
    meta = _meta(x.shape[1:], len(classes), classes, mean, std, f"image-folder {folder}")
    return {"kind": "image-folder",
            "datasets": [write_dataset(uri, x, np.asarray(labels), meta, shards, overwrite)]}


def _to_int(v):
    return int(v)


def _to_bool(v):
    if isinstance(v, str):
        if v.lower() in ("1", "true", "yes", "on"):
            return True
        if v.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(v)
    return bool(v)


def _to_size(v):
    if isinstance(v, str):
        parts = v.lower().replace(",", "x").split("x")
        return tuple(int(p) for p in parts) if len(parts) == 2 else int(parts[0])
    return v if np.isscalar(v) else tuple(int(s) for s in v)


def _load_npz(path):
    try:
        with np.load(path) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise DataError(f"{path}: no array named {missing[0]!r} (has {', '.join(z.files)}); "
                                f"save it with np.savez(path, x=images, y=labels)")
            return z["x"], z["y"]
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read the .npz ({_one_line(e)}); save it with "
                        f"np.savez(path, x=images, y=labels)") from None


# kind -> (function, {option: converter}, required options)
_IMPORTS = {
    "digits": (import_digits, {"shards": _to_int, "overwrite": _to_bool}, ()),
    "synthetic-cifar": (import_synthetic_cifar, {"n_train": _to_int, "n_test": _to_int, "shards": _to_int,
                                                 "seed": _to_int, "overwrite": _to_bool}, ()),
    "arrays": (None, {"path": str, "shards": _to_int, "num_classes": _to_int, "overwrite": _to_bool},
               ("path",)),
    "image-folder": (import_image_folder, {"folder": str, "size": _to_size, "mode": str,
                                           "shards": _to_int, "overwrite": _to_bool}, ("folder",)),
}
IMPORT_KINDS = tuple(_IMPORTS)


def run_import(kind, uri, options=None):
    """Import a dataset of `kind` to `uri` (what `yarnapp data import KIND URI` runs).

    options (strings are converted, so CLI `key=value` pairs can be passed as they are):
      digits:          shards, overwrite                -> uri/train, uri/test
      synthetic-cifar: n_train, n_test, shards, seed, overwrite -> uri/train, uri/test
      arrays:          path (an .npz with x, y), shards, num_classes, overwrite -> uri
      image-folder:    folder, size ("HxW"), mode (RGB|L), shards, overwrite -> uri
    Returns {"kind": kind, "datasets": [{"uri", "rows", "shards", "shape", "num_classes",
    "mean", "std"}, ...]}.
    """
    if kind not in _IMPORTS:
        raise DataError(f"unknown dataset kind {kind!r}; choose one of {', '.join(IMPORT_KINDS)}")
    func, allowed, required = _IMPORTS[kind]
    options = dict(options or {})
    kwargs = {}
    for key, value in options.items():
        if key not in allowed:
            raise DataError(f"{kind}: unknown option {key!r}; options are {', '.join(sorted(allowed))}")
        try:
            kwargs[key] = allowed[key](value)
        except (TypeError, ValueError):
            raise DataError(f"{kind}: option {key}={value!r} is not a valid value") from None
    for key in required:
        if key not in kwargs:
            raise DataError(f"{kind}: option {key!r} is required")
    if kind == "arrays":
        x, y = _load_npz(kwargs.pop("path"))
        return import_arrays(uri, x, y, **kwargs)
    return func(uri, **kwargs)


# ----------------------------------------------------------------------------- reading

class ParquetDataset:
    """A dataset directory (or a single .parquet file) read into memory as numpy.

    Shards are listed and validated (schema and metadata from their footers) on
    construction, then read one by one (`read_shard`) into `images` (uint8,
    N x C x H x W) and `labels` (int64). Any problem raises DataError naming the
    URI or the shard.
    """

    def __init__(self, uri):
        self.uri = uri
        self._fs, self._path = _filesystem(uri)
        self.files = self._list()                   # paths inside the filesystem, sorted
        self.meta = None
        self.shard_rows = [self._validate(f) for f in self.files]
        self.shape = tuple(self.meta["shape"])
        self.num_classes = self.meta["num_classes"]
        self.classes = list(self.meta.get("classes") or range(self.num_classes))
        self.mean = np.asarray(self.meta["mean"], np.float32)
        self.std = np.asarray(self.meta["std"], np.float32)
        n = sum(self.shard_rows)
        self.images = np.empty((n,) + self.shape, np.uint8)
        self.labels = np.empty(n, np.int64)
        at = 0
        for i, rows in enumerate(self.shard_rows):
            self.images[at:at + rows], self.labels[at:at + rows] = self.read_shard(i)
            at += rows
        log.info("read %s: %d rows from %d shards, shape %s, %d classes",
                 uri, n, len(self.files), self.shape, self.num_classes)

    def __len__(self):
        return len(self.labels)

    def __repr__(self):
        return f"ParquetDataset({self.uri!r}, rows={len(self)}, shape={self.shape}, classes={self.num_classes})"

    def _name(self, path):
        """How error messages name a shard: the dataset URI plus the file name."""
        if path == self._path:
            return self.uri
        return _join(self.uri, posixpath.basename(path))

    def _list(self):
        info = _info(self._fs, self._path, self.uri)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"no dataset at {self.uri}: it does not exist; {_IMPORT_HINT}")
        if info.type == pafs.FileType.File:
            return [self._path]
        try:
            entries = self._fs.get_file_info(pafs.FileSelector(self._path, recursive=False))
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"cannot list {self.uri}: {_one_line(e)}") from None
        files = sorted(e.path for e in entries if e.type == pafs.FileType.File
                       and e.base_name.endswith(".parquet") and not e.base_name.startswith((".", "_")))
        if not files:
            raise DataError(f"no dataset at {self.uri}: the directory holds no .parquet shards; {_IMPORT_HINT}")
        return files

    def _footer(self, path):
        """(arrow schema, row count) from a shard's footer."""
        try:
            with self._fs.open_input_file(path) as f:
                pf = pq.ParquetFile(f)
                return pf.schema_arrow, pf.metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{self._name(path)}: not a readable Parquet file ({_one_line(e)}); "
                            f"re-import the dataset or remove the file") from None

    def _validate(self, path):
        """Check one shard's schema and metadata; returns its row count."""
        name = self._name(path)
        schema, num_rows = self._footer(path)
        try:
            raw = (schema.metadata or {}).get(META_KEY)
            if raw is None:
                raise ValueError("no 'yarnapp' entry")
            meta = json.loads(raw)
            shape = [int(s) for s in meta["shape"]]
            num_classes = int(meta["num_classes"])
            if len(shape) != 3 or len(meta["mean"]) != shape[0] or len(meta["std"]) != shape[0]:
                raise ValueError("shape must be [C, H, W] with one mean/std per channel")
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{name}: no valid yarnapp metadata in the Parquet schema ({_one_line(e)}; "
                            f"it holds shape, num_classes, mean, std); {_IMPORT_HINT}") from None
        width = int(np.prod(shape))
        for column in (IMAGE, LABEL):
            if schema.get_field_index(column) < 0:
                raise DataError(f"{name}: no column {column!r} (columns: {', '.join(schema.names)}); "
                                f"{_IMPORT_HINT}")
        image_type = schema.field(IMAGE).type
        if not (pa.types.is_fixed_size_binary(image_type) and image_type.byte_width == width):
            raise DataError(f"{name}: column 'image' is {image_type}, expected fixed_size_binary[{width}] "
                            f"(C*H*W uint8 pixels for shape {shape}); {_IMPORT_HINT}")
        if not pa.types.is_integer(schema.field(LABEL).type):
            raise DataError(f"{name}: column 'label' is {schema.field(LABEL).type}, expected int64; "
                            f"{_IMPORT_HINT}")
        if self.meta is None:
            self.meta = meta
        elif (shape, num_classes) != (self.meta["shape"], self.meta["num_classes"]):
            raise DataError(f"{name}: shape {shape} / {num_classes} classes differ from "
                            f"{self._name(self.files[0])}; the directory mixes datasets")
        return num_rows

    def read_shard(self, i):
        """(images uint8 (n, C, H, W), labels int64 (n,)) of shard i, checked."""
        path = self.files[i]
        name = self._name(path)
        try:
            with self._fs.open_input_file(path) as f:
                table = pq.ParquetFile(f).read(columns=[IMAGE, LABEL])
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{name}: corrupt Parquet data ({_one_line(e)}); re-import the dataset") from None
        image = table.column(IMAGE).combine_chunks()
        label = table.column(LABEL)
        if image.null_count or label.null_count:
            raise DataError(f"{name}: {image.null_count + label.null_count} null images/labels; {_IMPORT_HINT}")
        n = len(image)
        if n != self.shard_rows[i]:
            raise DataError(f"{name}: footer says {self.shard_rows[i]} rows, read {n}")
        width = image.type.byte_width
        pixels = np.frombuffer(image.buffers()[1], np.uint8, count=n * width, offset=image.offset * width)
        labels = label.to_numpy().astype(np.int64, copy=False)
        if n and (labels.min() < 0 or labels.max() >= self.num_classes):
            bad = labels[(labels < 0) | (labels >= self.num_classes)][0]
            raise DataError(f"{name}: label {bad} outside [0, {self.num_classes}); {_IMPORT_HINT}")
        return pixels.reshape((n,) + self.shape), labels


# ----------------------------------------------------------------------------- loading

@dataclasses.dataclass
class LoaderStats:
    """What the loader measured since it was created."""
    batches: int = 0          # batches handed to the consumer
    samples: int = 0          # rows handed to the consumer
    wait_s: float = 0.0       # time the consumer was blocked waiting for a batch
    read_samples: int = 0     # rows the reader assembled (may run ahead by `prefetch` batches)
    read_s: float = 0.0       # time the reader spent assembling them (gather + normalise)

    @property
    def samples_per_s(self):
        """Read throughput: rows assembled per second of reader time."""
        return self.read_samples / self.read_s if self.read_s > 0 else 0.0

    def as_dict(self):
        return {**dataclasses.asdict(self), "samples_per_s": self.samples_per_s}


_END = object()


class _Failure:
    def __init__(self, exc):
        self.exc = exc


class Loader:
    """This rank's rows of every global batch, epoch after epoch, read ahead in a thread.

    Epoch e visits the dataset in the order of a permutation drawn from (seed, e)
    alone, so every rank (and every restart) sees the same global batches: batch s
    of epoch e is rows perm[s*B:(s+1)*B], and this rank gets rows [lo:hi) of it.
    Ranks with unequal shares read different slices of the SAME batch, and the
    slices of all ranks concatenate to the batch one rank reading [0:B) would get.

    With drop_last=False the last batch of an epoch has B' < B rows; its slices are
    scaled to [lo*B'//B : hi*B'//B), which still tile it exactly (a slice may be
    empty). Iterating yields (epoch, step, x, y): x float32 (n, C, H, W) normalised
    with the dataset's mean/std, y int64 (n,). Iteration starts at (start_epoch,
    start_step) and runs through epoch `epochs - 1` (forever when epochs is None);
    iterating again starts there again. Permutations use numpy's PCG64 seeded with
    SeedSequence([seed, epoch]); ranks of one world must share a numpy version.
    """

    def __init__(self, dataset, global_batch, lo, hi, seed, start_epoch=0, start_step=0,
                 prefetch=4, drop_last=True, epochs=None):
        self.dataset = dataset
        self.global_batch = int(global_batch)
        self.lo, self.hi = int(lo), int(hi)
        self.seed = int(seed)
        self.prefetch = int(prefetch)
        self.drop_last = bool(drop_last)
        self.epochs = epochs
        n = len(dataset)
        if self.global_batch < 1:
            raise ValueError(f"global batch must be at least 1, got {global_batch}")
        if not 0 <= self.lo <= self.hi <= self.global_batch:
            raise ValueError(f"batch slice [{lo}:{hi}) is not inside a global batch of {global_batch}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if self.steps_per_epoch == 0:
            raise DataError(f"global batch {self.global_batch} is larger than the {n} rows of "
                            f"{getattr(dataset, 'uri', 'the dataset')}; lower the batch size")
        self.start_epoch = int(start_epoch) + int(start_step) // self.steps_per_epoch
        self.start_step = int(start_step) % self.steps_per_epoch
        self._mean = np.asarray(dataset.mean, np.float32).reshape(1, -1, 1, 1)
        self._std = np.asarray(dataset.std, np.float32).reshape(1, -1, 1, 1)
        self._stats = LoaderStats()
        self._perm_cache = (None, None)
        self._thread = None
        self._stop = None
        self._queue = None

    @property
    def steps_per_epoch(self):
        n = len(self.dataset)
        return n // self.global_batch if self.drop_last else -(-n // self.global_batch)

    @property
    def stats(self):
        """A snapshot of the LoaderStats."""
        return dataclasses.replace(self._stats)

    def permutation(self, epoch):
        """The order in which epoch `epoch` visits the dataset's rows."""
        cached_epoch, perm = self._perm_cache
        if cached_epoch != epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed % 2 ** 64, int(epoch)]))
            perm = rng.permutation(len(self.dataset))
            self._perm_cache = (epoch, perm)
        return perm

    def rows(self, epoch, step):
        """Dataset row indices of this rank's slice of batch `step` of `epoch`."""
        perm = self.permutation(epoch)
        start = step * self.global_batch
        size = min(self.global_batch, len(perm) - start)
        if size == self.global_batch:
            lo, hi = self.lo, self.hi
        else:
            lo, hi = self.lo * size // self.global_batch, self.hi * size // self.global_batch
        return perm[start + lo:start + hi]

    def batch(self, epoch, step):
        """(x, y) tensors of this rank's slice of one batch (no prefetch, no statistics)."""
        import torch

        idx = self.rows(epoch, step)
        x = torch.from_numpy(self.dataset.images[idx]).to(torch.float32)
        x.sub_(torch.from_numpy(self._mean)).div_(torch.from_numpy(self._std))
        return x, torch.from_numpy(self.dataset.labels[idx])

    def _positions(self):
        epoch, step = self.start_epoch, self.start_step
        while self.epochs is None or epoch < self.epochs:
            yield epoch, step
            step += 1
            if step == self.steps_per_epoch:
                epoch, step = epoch + 1, 0

    def _read(self, epoch, step):
        t0 = time.perf_counter()
        x, y = self.batch(epoch, step)
        self._stats.read_s += time.perf_counter() - t0
        self._stats.read_samples += len(y)
        return epoch, step, x, y

    def _produce(self, q, stop):
        def put(item):
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            for epoch, step in self._positions():
                if stop.is_set() or not put(self._read(epoch, step)):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer, which re-raises it
            put(_Failure(e))

    def __iter__(self):
        self.close()
        if self.prefetch == 0:
            return self._iter_sync()
        return self._iter_prefetch()

    def _iter_sync(self):
        for epoch, step in self._positions():
            t0 = time.perf_counter()
            item = self._read(epoch, step)
            self._stats.wait_s += time.perf_counter() - t0
            self._stats.batches += 1
            self._stats.samples += len(item[3])
            yield item

    def _iter_prefetch(self):
        q = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(q, stop), name="yarnapp-loader", daemon=True)
        self._queue, self._stop, self._thread = q, stop, thread
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                self._stats.wait_s += time.perf_counter() - t0
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                self._stats.batches += 1
                self._stats.samples += len(item[3])
                yield item
        finally:
            if self._thread is thread:
                self.close()

    def close(self):
        """Stop the read-ahead thread (if any) and wait for it; iterating again restarts."""
        thread, stop, q = self._thread, self._stop, self._queue
        self._thread = self._stop = self._queue = None
        if thread is None:
            return
        stop.set()
        while thread.is_alive():
            try:
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
