"""Per-channel mean and std of a dataset's pixels (pixel units), for normalisation.

Where they come from, first found: training.data.mean/std in the job; yarnapp's
metadata in the files; the training set's (for its test set); a cache file beside the
dataset; else they are computed from a sample of decoded images (up to SAMPLE_ROWS
rows, spread evenly over up to SAMPLE_BLOCKS blocks across the dataset) and written to
that cache for the next run:

    <dataset directory>/_yarnapp_stats.json        (or `.<file>.yarnapp_stats.json`
                                                    beside a single-file dataset)

The cache holds the files' names, sizes and modification times and is ignored when they
change. In a
world, rank 0 computes (or reads) them and broadcasts them, so every rank normalises
with the very same numbers.
"""
import hashlib
import json
import logging
import os
import posixpath
import stat
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from .common import DataError, one_line, split_query
from .decode import decode, gather
from .listing import GLOB_CHARS
from .reader import _Files, read_block

log = logging.getLogger(__name__)

SAMPLE_ROWS = 4096
SAMPLE_BLOCKS = 16
CACHE_NAME = "_yarnapp_stats.json"


def _cache_path(layout):
    if len(layout.paths) == 1 and layout.fs.get_file_info(layout.paths[0]).type == pafs.FileType.File \
            and layout.uri.rstrip("/").endswith(posixpath.basename(layout.paths[0])):
        d, f = posixpath.split(layout.paths[0])
        return posixpath.join(d, f".{f}.yarnapp_stats.json")
    pattern = posixpath.basename(split_query(layout.uri)[0])
    name = CACHE_NAME
    if any(c in pattern for c in GLOB_CHARS):     # a glob's files: beside other patterns' (train-*, validation-*)
        name = CACHE_NAME.replace(".json", f".{hashlib.sha1(pattern.encode()).hexdigest()[:8]}.json")
    return posixpath.join(layout.root, name)


def _fingerprint(layout):
    infos = layout.fs.get_file_info(layout.paths)       # a file rewritten at its size has another mtime
    return [[posixpath.relpath(i.path, layout.root), int(i.size or 0), int(i.mtime_ns or 0)] for i in infos] + \
        [layout.columns.image]


def _read_cache(layout, path, channels):
    try:
        with layout.fs.open_input_stream(path) as f:
            cached = json.loads(f.read())
        if cached.get("fingerprint") == _fingerprint(layout) and len(cached["mean"]) == channels:
            return np.asarray(cached["mean"], np.float64), np.asarray(cached["std"], np.float64)
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_cache(layout, path, mean, std, rows):
    body = json.dumps({"fingerprint": _fingerprint(layout), "mean": mean.tolist(), "std": std.tolist(),
                       "rows": rows, "time": time.time()}).encode()
    tmp = f"{path}.tmp-{time.time_ns()}"
    try:
        with layout.fs.open_output_stream(tmp) as f:
            f.write(body)
        if isinstance(layout.fs, pafs.LocalFileSystem):     # readable by whoever reads the dataset (a
            os.chmod(tmp, stat.S_IMODE(os.stat(layout.paths[0]).st_mode))   # container's umask is 077)
        layout.fs.move(tmp, path)
    except (pa.ArrowException, OSError) as e:
        log.info("mean/std of %s not cached (%s); they are computed again next time", layout.uri, one_line(e))
        try:
            layout.fs.delete_file(tmp)
        except (pa.ArrowException, OSError):
            pass


def compute(layout, channels):
    """(mean, std, rows) per channel of a sample of the dataset's decoded images, and how
    many images the sample had."""
    t0 = time.perf_counter()
    nb = len(layout.blocks)
    picks = sorted(set(np.linspace(0, nb - 1, min(nb, SAMPLE_BLOCKS)).round().astype(int).tolist()))
    per_block = max(1, SAMPLE_ROWS // len(picks))
    total = np.zeros(channels)
    total_sq = np.zeros(channels)
    count = rows = 0
    files = _Files(layout)
    try:
        for b in picks:
            block = layout.blocks[b]
            data, _ = read_block(layout, files, block)
            offsets = np.unique(np.linspace(0, block.rows - 1, min(block.rows, per_block)).round().astype(np.int64))
            images, _ = gather(data, offsets)
            rows += len(offsets)
            first = layout.starts[b]        # the block's first row in the dataset: errors name the file's row
            for img in decode(images, layout.shape, channels, lambda i: layout.where(first + int(offsets[i]))):
                px = img.reshape(-1, img.shape[-1]).astype(np.float64)
                total += px.sum(axis=0)
                total_sq += np.square(px).sum(axis=0)
                count += len(px)
    finally:
        files.close()
    mean = total / max(count, 1)
    std = np.sqrt(np.maximum(total_sq / max(count, 1) - mean ** 2, 0.0))
    std = np.where(std > 1e-6, std, 1.0)
    log.info("%s: mean %s std %s from %d pixels of %d blocks in %.1fs", layout.uri, np.round(mean, 2),
             np.round(std, 2), count, len(picks), time.perf_counter() - t0)
    return mean, std, rows


def resolve(layout, channels, given=None, comm=None):
    """(mean, std) as float32 arrays, from `given` (mean, std), the metadata, the cache, or
    computed (by rank 0 of `comm` when given, then broadcast)."""
    if given is not None and given[0] is not None:
        mean, std = given
    elif layout.meta.get("mean") is not None and layout.meta.get("std") is not None:
        mean, std = layout.meta["mean"], layout.meta["std"]
    else:
        mean = std = None
        if comm is None or comm.Get_rank() == 0:
            try:
                path = _cache_path(layout)
                found = _read_cache(layout, path, channels)
                if found is not None:
                    log.info("%s: mean %s std %s from %s (delete it to measure them again)", layout.uri,
                             np.round(found[0], 2), np.round(found[1], 2), path)
                else:
                    *found, rows = compute(layout, channels)
                    _write_cache(layout, path, *found, rows)
                mean, std = found
            except DataError as e:
                mean = e
        if comm is not None and comm.Get_size() > 1:
            mean, std = comm.bcast((mean, std), root=0)
        if isinstance(mean, DataError):
            raise mean
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    if mean.shape != (channels,) or std.shape != (channels,):
        raise DataError(f"{layout.uri}: mean/std have {mean.size}/{std.size} values for {channels} channels; "
                        f"give one per channel in training.data.mean/std")
    return mean, std
