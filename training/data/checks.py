"""Checks of a Parquet image dataset before any rank reads it, from its footers (the label
column of a file written without statistics, and the first image): what `yarnapp submit`
refuses at once (yarnapp.preflight) that a rank would otherwise meet mid-epoch: no rows,
no labels, null labels or images, labels outside the classes, bytes that are no image, a
test set whose classes are not the training set's (checked by the ranks too,
training.data.source). What a dataset holds is
training.data.formats'.
"""
import dataclasses
import shlex
from typing import List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .common import IO_ERRORS, DataError, one_line
from .formats import (RAW, STRUCT, Block, Columns, blocks_of, hf_classes, read_footers, read_label_range, too_many,
                      wanted_columns)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What `check` found in a dataset's footers."""
    rows: int
    shape: Optional[tuple]          # its images' [C, H, W] where the files say (raw pixels), else None
    blocks: List[Block]
    classes: Optional[list]         # its class names where its metadata gives them, else None
    num_classes: Optional[int]      # from its metadata, else the largest label + 1 where the statistics say
    lowest: Optional[int] = None    # its smallest label, where the statistics say
    named: bool = False             # its metadata (ours or Hugging Face's) gives the number of classes
    one_class_files: bool = False   # its labels or class names come from directories: a file holds one class
    class_column: bool = False      # it has the class-name column asked for (training.data.columns.class_name)


def check(uri, columns=None, shape=None, named=False):
    """Raise DataError (Unreachable where the filesystem cannot be reached) unless `uri`
    holds a dataset `inspect` can open: every file's footer read, no rows, no labels, no
    null label or image (the footers' statistics; a file's label column where it has none),
    no label outside the metadata's classes.
    Returns what it found (Checked). named: the classes are named elsewhere (a test set's,
    by its training set): no class-name column is needed."""
    f = read_footers(uri, columns or Columns(), shape, named)
    columns, meta, kind = f.columns, f.meta, f.kind
    n = int(meta["num_classes"]) if meta.get("num_classes") else None
    top, low = -1, None                     # the largest and smallest label, while every footer gives them
    image = f"{columns.image}.bytes" if kind == STRUCT else columns.image     # a path alone is no image
    # labels outside the classes: found in a rank mid-epoch otherwise
    for i, (name, md) in enumerate(zip(f.names, f.footers)):
        for column, what in ((columns.label, "a label"), (image, "an image")):
            nulls = f.nulls(i, column)
            if nulls:
                raise DataError(f"{name}: {nulls} row(s) without {what} (null in column {column!r}, its footer's "
                                f"statistics); drop those rows, or give each {what}")
        try:
            r = f.labels(i)
        except (TypeError, ValueError):     # statistics that are not integers: the ranks' check
            r = None
        says = "its directory" if columns.label in f.partitions[i] else "its footer's statistics"
        if r is None and md.num_rows and columns.label not in f.partitions[i] and \
                pa.types.is_integer(md.schema.to_arrow_schema().field(columns.label).type):
            r, says = read_label_range(f.fs, f.paths[i], name, columns.label), "its label column"     # no statistics
        if r and n and (r[0] < 0 or r[1] >= n):
            raise DataError(f"{name}: its labels run from {r[0]} to {r[1]} ({says}), "
                            f"outside the {n} classes the dataset's metadata gives (0 to {n - 1}); "
                            f"fix the labels, or import the dataset again")
        if r and r[0] < 0:
            raise DataError(f"{name}: its labels run from {r[0]} to {r[1]} ({says}); labels "
                            f"must be class indices >= 0")
        if top is not None and md.num_rows:
            top, low = (max(top, r[1]), r[0] if low is None else min(low, r[0])) if r else (None, None)
    if top is not None:
        too_many(uri, top)
    if kind != RAW:
        _check_first_image(f.fs, f.paths, f.names, f.footers, columns, kind, shape)
    blocks = [b for i, md in enumerate(f.footers) for b in blocks_of(i, md, wanted_columns(columns))]
    named = [str(c) for c in meta["classes"]] if meta.get("classes") else \
        hf_classes(f.footers[0].schema.to_arrow_schema(), columns.label)
    by_directory = None if named else _classes_from_directories(f)
    return Checked(rows=sum(md.num_rows for md in f.footers), shape=f.shape if kind == RAW else None,
                   blocks=blocks, classes=named or by_directory or None,
                   num_classes=n or (len(named) if named else None) or (top + 1 if top is not None else None),
                   lowest=low, named=bool(n or named),
                   one_class_files=any(c in part for part in f.partitions for c in (columns.label, columns.class_name)),
                   class_column=bool(columns.class_name))     # (read_footers drops one the files lack)


def _classes_from_directories(f):
    """The class names where partitionBy's directories give them (class_name=cat/) and every
    file's footer gives it one label; else None (the ranks read them)."""
    col = f.columns.class_name
    if not col or not all(col in part for part in f.partitions):
        return None
    seen = {}
    for i, (name, part) in enumerate(zip(f.names, f.partitions)):
        if not f.footers[i].num_rows:
            continue
        try:
            r = f.labels(i)
        except (TypeError, ValueError):
            return None
        if not r or r[0] != r[1] or r[0] < 0:
            return None
        if seen.setdefault(r[0], str(part[col])) != str(part[col]):
            raise DataError(f"{name}: label {r[0]} is class {str(part[col])!r} here and {seen[r[0]]!r} in another "
                            f"directory; check training.data.columns.class_name")
    return [seen.get(k, str(k)) for k in range(max(seen) + 1)] if seen else None


def check_test_classes(uri, classes, num_classes, train_uri, train_classes, train_num_classes):
    """Raise DataError where a test set's labels go past the training set's classes (the
    model has no output for them), or its class names give its labels other meanings than
    the training set's (a test folder imported without one of the training folder's
    classes: scored against the wrong classes, accuracy 0 and no word). Fewer classes are
    fine; class names that are only the label numbers say nothing; what is not known (None)
    is not checked. The ranks' check (training.data.source) and the client's (footers only,
    yarnapp.preflight)."""
    if num_classes and train_num_classes and num_classes > train_num_classes:
        raise DataError(f"{uri}: its labels go up to {num_classes - 1} ({num_classes} classes), the training "
                        f"set's ({train_uri}) to {train_num_classes - 1}: the model has {train_num_classes} "
                        f"outputs; give a test set of the training set's classes")

    def named(names):
        return names is not None and list(names) != [str(i) for i in range(len(names))]
    if not (named(classes) and named(train_classes)):
        return
    names = shlex.quote(",".join(train_classes))
    for label, (mine, theirs) in enumerate(zip(classes, train_classes)):
        if mine != theirs:
            raise DataError(
                f"{uri}: its label {label} is class {mine!r}, in the training set ({train_uri}) {theirs!r}; "
                f"import it with the training set's classes in their order (yarnapp data import image-folder "
                f"... --classes {names if len(names) <= 120 else 'NAME,NAME,...'})")


def _check_first_image(fs, paths, names, footers, columns, kind, shape):
    """Decode the first image of the dataset (one row read): raw pixels written as plain
    binary, or bytes of another kind, would otherwise be found in the ranks at their first step."""
    from .decode import decode_one, why_not_image
    i = next(k for k, md in enumerate(footers) if md.num_rows)
    try:
        with fs.open_input_file(paths[i]) as f:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=1, columns=[columns.image]))
    except IO_ERRORS as e:
        raise DataError(f"{names[i]}: cannot read its first image ({one_line(e)})") from None
    value = batch.column(0)[0].as_py()
    blob = value.get("bytes") if kind == STRUCT and isinstance(value, dict) else value
    if blob is None:
        raise DataError(f"{names[i]} (row 0): column {columns.image!r} holds no image bytes" +
                        (" (only a path: embed the images in the file)" if kind == STRUCT else
                         "; every row needs an image"))
    try:
        decode_one(blob, 3)
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for bad bytes
        raw = f"pa.binary({len(blob)})"
        hint = (f"its {len(blob)} bytes are C*H*W of training.data.shape {list(shape)}: write raw pixels as a "
                f"fixed-size binary column ({raw})" if shape and int(np.prod(shape)) == len(blob) else
                f"write encoded images (PNG, JPEG), or raw uint8 pixels as a fixed-size binary column ({raw}) "
                f"with training.data.shape")
        raise DataError(f"{names[i]} (row 0): column {columns.image!r} holds {len(blob)} bytes that are not an "
                        f"image ({why_not_image(e)}); {hint}") from None
