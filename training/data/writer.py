"""Writing a dataset as Parquet shards, atomically, on any pyarrow filesystem.

The files `yarnapp data import` writes (one directory per dataset):

    <uri>/part-00000.parquet, part-00001.parquet, ...
        image  fixed_size_binary(C*H*W)   raw uint8 pixels in C,H,W order, or
               binary                     the encoded file (JPEG, PNG, ...) as it is
        label  int64                      0 <= label < num_classes
    schema metadata b"yarnapp" = JSON {"format": 2, "encoding": "raw"|"encoded",
        "shape": [C, H, W] (raw; null for encoded), "num_classes": K, "classes": [names],
        "mean": [per channel] | null, "std": [per channel] | null}

Rows are cut into row groups of about ROW_GROUP_BYTES, the unit the streaming reader
reads and the shuffle permutes. `mean`/`std` are in pixel units, measured on the
training split (null: computed on first use, training.data.stats).

A dataset appears atomically: it is written under a hidden sibling name
(`.<name>.tmp-<random>`) and renamed into place, so readers never see half of one.
Rename is atomic on local filesystems and HDFS; on object stores (s3://) a "move"
is a copy, so there a crash can leave a partial dataset behind.
"""
import json
import logging
import posixpath
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from launcher import interrupts

from .common import IO_ERRORS, DataError, Unreachable, exists, filesystem, info, one_line
from .formats import META_KEY
from .listing import is_shard

log = logging.getLogger(__name__)

IMAGE = "image"
LABEL = "label"
FORMAT = 2
ROW_GROUP_BYTES = 2 << 20


def meta(shape, num_classes, classes, mean, std, source, encoding="raw"):
    """The b"yarnapp" schema metadata (see the module docstring)."""
    return {"format": FORMAT, "encoding": encoding, "shape": [int(s) for s in shape] if shape else None,
            "num_classes": int(num_classes), "classes": [str(c) for c in classes],
            "mean": [float(m) for m in mean] if mean is not None else None,
            "std": [float(s) for s in std] if std is not None else None, "source": source}


def channel_stats(images):
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


def check_absent(uri, overwrite):
    """Refuse `uri` where it exists, unless `overwrite` and it is a dataset (check_replaceable)."""
    fs, path = filesystem(uri)
    if exists(fs, path, uri):
        check_replaceable(fs, path, uri, overwrite)


def check_replaceable(fs, path, uri, overwrite):
    """`uri`, which exists, may be written over: with `overwrite`, and where it is a dataset
    yarnapp writes, nothing else: a directory of Parquet shards and their side files (files
    named _* or .*: _SUCCESS, _metadata, _yarnapp_stats.json). Anything else there (a
    project's files, a subdirectory, the images being imported, an .npz) is refused, and
    nothing is written."""
    if not overwrite:
        raise DataError(f"{uri} already exists; delete it, or import again with --overwrite")
    what = info(fs, path, uri)
    if what.type != pafs.FileType.Directory:
        raise DataError(f"{uri} is a file, not a directory of Parquet shards as an import writes; --overwrite "
                        f"replaces only such a directory: give another path, or delete it yourself")
    try:
        entries = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    except IO_ERRORS as e:
        raise Unreachable(f"cannot list {uri}: {one_line(e)}") from None
    for entry in entries:
        side = entry.type == pafs.FileType.File and entry.base_name.startswith((".", "_"))
        if not (is_shard(entry) or side):
            raise DataError(f"{uri} holds {entry.base_name!r}, which is not a dataset's Parquet shard; "
                            f"--overwrite replaces only a dataset: give another path, or delete it yourself")


def check_splits_parent(uri, what):
    """Refuse to write `uri`/train and `uri`/test into a directory that is itself a dataset
    (its own Parquet shards): they would nest inside it, overwrite or not."""
    fs, path = filesystem(uri)
    if info(fs, path, uri).type != pafs.FileType.Directory:
        return
    if any(map(is_shard, fs.get_file_info(pafs.FileSelector(path, recursive=False)))):
        raise DataError(f"{uri} holds a dataset of its own (Parquet shards); {what} writes {uri}/train and "
                        f"{uri}/test: give another path")


def _raw_table(images, labels, meta_bytes):
    n = len(images)
    width = int(np.prod(images.shape[1:]))
    pixels = np.ascontiguousarray(images, dtype=np.uint8).reshape(-1)
    image = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(pixels)])
    schema = pa.schema([(IMAGE, pa.binary(width)), (LABEL, pa.int64())], metadata={META_KEY: meta_bytes})
    return pa.Table.from_arrays([image, pa.array(labels, type=pa.int64())], schema=schema)


def _encoded_table(blobs, labels, meta_bytes):
    schema = pa.schema([(IMAGE, pa.binary()), (LABEL, pa.int64())], metadata={META_KEY: meta_bytes})
    return pa.Table.from_arrays([pa.array(blobs, type=pa.binary()), pa.array(labels, type=pa.int64())],
                                schema=schema)


def _check_labels(labels, num_classes, n, what):
    if len(labels) != n:
        raise DataError(f"{what}: {n} images but {len(labels)} labels")
    if n == 0:
        raise DataError(f"{what}: no images to write")
    if labels.min() < 0:
        raise DataError(f"{what}: labels are class indices from 0, got {labels.min()}..{labels.max()}; shift them "
                        f"to start at 0")
    if labels.max() >= num_classes:
        raise DataError(f"{what}: labels must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")


def write_dataset(uri, images, labels, meta, shards=2, overwrite=False):
    """Write raw uint8 images (N, C, H, W) and int labels as one dataset at `uri`.

    `meta` is the schema metadata dict (`meta()` builds it). Returns the summary dict.
    """
    images = np.asarray(images)
    labels = np.asarray(labels, dtype=np.int64)
    if images.ndim != 4:
        raise DataError(f"{uri}: images must be (N, C, H, W) or (N, H, W), got shape {images.shape}")
    _check_labels(labels, meta["num_classes"], len(images), uri)
    if images.dtype != np.uint8:
        raise DataError(f"{uri}: images must be uint8 pixels, got {images.dtype}")
    if list(images.shape[1:]) != meta["shape"]:
        raise DataError(f"{uri}: images have shape {images.shape[1:]}, metadata says {meta['shape']}")
    rows_per_group = max(1, ROW_GROUP_BYTES // int(np.prod(images.shape[1:])))
    meta_bytes = json.dumps(meta).encode()
    return _write(uri, len(images), shards, overwrite, meta, rows_per_group,
                  lambda a, b: _raw_table(images[a:b], labels[a:b], meta_bytes))


def write_encoded(uri, blobs, labels, meta, shards=2, overwrite=False):
    """Write encoded images (a list of bytes: JPEG, PNG...) as they are, and int labels."""
    labels = np.asarray(labels, dtype=np.int64)
    _check_labels(labels, meta["num_classes"], len(blobs), uri)
    mean_size = max(1, sum(len(b) for b in blobs) // len(blobs))
    rows_per_group = max(1, ROW_GROUP_BYTES // mean_size)
    meta_bytes = json.dumps(meta).encode()
    return _write(uri, len(blobs), shards, overwrite, meta, rows_per_group,
                  lambda a, b: _encoded_table(blobs[a:b], labels[a:b], meta_bytes))


def _remove(fs, path):
    try:
        fs.delete_dir(path)
    except (pa.ArrowException, OSError):
        pass


def _write(uri, n, shards, overwrite, meta, rows_per_group, table_of):
    fs, path = filesystem(uri)
    path = path.rstrip("/") or "/"
    parent, name = posixpath.split(path)
    there = exists(fs, path, uri)
    if there:
        check_replaceable(fs, path, uri, overwrite)
    shards = max(1, min(int(shards), n))
    bounds = np.linspace(0, n, shards + 1).round().astype(int)
    tmp = posixpath.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    old, replaced = posixpath.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}"), False
    try:
        fs.create_dir(tmp, recursive=True)
        for i in range(shards):
            table = table_of(bounds[i], bounds[i + 1])
            with fs.open_output_stream(posixpath.join(tmp, f"part-{i:05d}.parquet")) as f:
                # images: no compression (raw pixels read fast; JPEG/PNG are compressed
                # already), no dictionary, no statistics; labels: both (the statistics
                # tell a reader the number of classes without reading them); every page
                # with its CRC, which the ranks' reader verifies (training.data.reader)
                pq.write_table(table, f, compression="none", use_dictionary=[LABEL],
                               write_statistics=[LABEL], data_page_size=1 << 20, write_page_checksum=True,
                               row_group_size=rows_per_group)
        if there:
            with interrupts.deferred():     # both moves or neither: a Ctrl-C between them would hide it
                fs.move(path, old)
                try:
                    fs.move(tmp, path)
                except BaseException:
                    fs.move(old, path)      # the old dataset back where it was
                    raise
                replaced = True
        else:
            fs.move(tmp, path)
    except BaseException as e:          # an I/O error, or Ctrl-C in a long import: no hidden copy left
        _remove(fs, tmp)
        if isinstance(e, (pa.ArrowException, OSError)):
            hint = "a part of its path is a file, not a directory: give another path" \
                if isinstance(e, NotADirectoryError) or "Not a directory" in str(e) else \
                "check that its directory is writable"
            raise DataError(f"cannot write {uri}: {one_line(e)}; {hint}") from None
        raise
    finally:
        if replaced:                    # however this ends (a Ctrl-C held over the moves included)
            _remove(fs, old)
    log.info("wrote %s: %d rows in %d shards, %s images, %d classes",
             uri, n, shards, meta.get("encoding"), meta["num_classes"])
    return {"uri": uri, "rows": int(n), "shards": shards, "encoding": meta.get("encoding"),
            "shape": meta["shape"], "num_classes": meta["num_classes"], "mean": meta["mean"], "std": meta["std"]}
