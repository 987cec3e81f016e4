"""What a Parquet image dataset holds, read from its footers: files, columns, the kind of
image column, classes, and the blocks it is read in.

Accepted (docs/data.md):
- the files training.data.listing finds at the URI: a directory's `.parquet` files, one
  file, a pattern, or Spark's partitionBy output (a column may come from its directories);
- an image column (`columns.image`, default "image") holding
    * encoded images (binary: JPEG, PNG, or anything Pillow reads),
    * a struct with a binary field `bytes` (Hugging Face datasets' `Image` feature), or
    * raw uint8 pixels in C,H,W order (fixed_size_binary(C*H*W)), with the shape from
      yarnapp's metadata or `training.data.shape`;
- an integer label column (`columns.label`, default "label"), and optionally a string
  column of class names (`columns.class_name`).

yarnapp's own schema metadata (b"yarnapp": {"shape", "num_classes", "classes", "mean",
"std"}, written by `yarnapp data import`) is optional. Without it the classes come from
Hugging Face's metadata (a ClassLabel's names), else from the class-name column, else
from the labels (the largest + 1); mean and std are given in job.yaml or computed
(training.data.stats).
"""
import bisect
import concurrent.futures
import dataclasses
import functools
import json
import logging
import posixpath
from typing import List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .common import (IMPORT_HINT, IO_ERRORS, MAX_CLASSES, DataError, Unreachable, filesystem, join, one_line,
                     split_query)
from .listing import HIVE_NULL, list_files, refuse_a_partition_itself, typed_labels

log = logging.getLogger(__name__)

META_KEY = b"yarnapp"
HF_KEY = b"huggingface"
MAX_BLOCK_BYTES = 32 << 20     # a row group bigger than this is read as row ranges of at most this
RAW, ENCODED, STRUCT = "raw", "encoded", "struct"


@dataclasses.dataclass(frozen=True)
class Columns:
    image: str = "image"
    label: str = "label"
    class_name: Optional[str] = None

    @classmethod
    def of(cls, spec):
        """From conf's training.data.columns (or None: the defaults)."""
        if spec is None:
            return cls()
        return cls(spec.image, spec.label, spec.class_name)


@dataclasses.dataclass(frozen=True)
class Block:
    """The unit of reading: a row group, or rows [offset, offset+rows) of a big one."""
    file: int
    row_group: int
    offset: int
    rows: int
    whole: bool            # the whole row group
    nbytes: int            # uncompressed bytes of the columns read (memory once read)
    read_bytes: int        # compressed bytes of the columns read (what a read transfers)
    span: tuple            # (offset, length) of the row group in its file

    @property
    def read_cost(self):
        """Bytes a read of it transfers: a row range of a big row group costs the bytes
        before it too (its pages are read from the row group's start)."""
        return self.read_bytes if self.whole else int(self.read_bytes * (self.offset + self.rows) / max(1, self.rows))


@dataclasses.dataclass
class Layout:
    uri: str
    fs: object
    paths: List[str]            # one per file, inside fs
    names: List[str]            # how messages name each file (the URI of the file)
    columns: Columns
    kind: str                   # RAW | ENCODED | STRUCT
    shape: Optional[tuple]      # (C, H, W) of raw pixels; None for encoded images
    meta: dict                  # yarnapp's metadata ({} when absent)
    classes: Optional[list]
    num_classes: int
    blocks: List[Block]
    root: str                   # the dataset's directory inside fs (the file's, for a single file)
    partitions: List[dict] = dataclasses.field(default_factory=list)   # per file: Hive directories' values

    @property
    def rows(self):
        return sum(b.rows for b in self.blocks)

    @property
    def nbytes(self):
        """Compressed bytes of the columns read over the whole dataset (one epoch's worth)."""
        return sum(b.read_bytes for b in self.blocks)

    def name(self, file):
        return self.names[file]

    @functools.cached_property
    def starts(self):
        """The dataset row each block starts at."""
        return np.cumsum([0] + [b.rows for b in self.blocks]).tolist()

    def where(self, row):
        """How messages name row `row` of the dataset (its index over every file, in blocks'
        order): "<file's URI> (row <its row in that file>)"."""
        starts = self.starts
        i = min(max(bisect.bisect_right(starts, row) - 1, 0), len(self.blocks) - 1)
        file = self.blocks[i].file
        first = next(j for j, b in enumerate(self.blocks) if b.file == file)
        return f"{self.names[file]} (row {row - starts[first]})"

    def read_columns(self):
        return [self.columns.image, self.columns.label] + ([self.columns.class_name] if self.columns.class_name else [])

    def file_columns(self, file):
        """The columns read from file `file`'s pages: read_columns() less those its Hive
        directories give (constant_columns)."""
        part = self.partitions[file] if self.partitions else {}
        return [c for c in self.read_columns() if c not in part]

    def constant_columns(self, file, rows):
        """{column: Arrow array of `rows` copies} of the columns file `file`'s Hive
        directories give (Spark's partitionBy: label=3/part-0.parquet)."""
        part = self.partitions[file] if self.partitions else {}
        return {c: constant(part[c], rows) for c in self.read_columns() if c in part}


def constant(value, rows):
    """An Arrow array of `rows` copies of a partition value (int64, float64 or string)."""
    if isinstance(value, (int, float)):
        return pa.array(np.full(rows, value, dtype=np.int64 if isinstance(value, int) else np.float64))
    return pa.array([value] * rows, pa.string())


def _footer(fs, path, name, single=False):
    """A Parquet file's footer (`single`: the file is the dataset's URI itself, not a shard
    of its directory)."""
    try:
        with fs.open_input_file(path) as f:
            return pq.ParquetFile(f).metadata
    except IO_ERRORS as e:
        if not _corrupt(e):              # not readable from here: permissions, a DataNode out of reach
            raise Unreachable(f"{name}: cannot read it from here ({one_line(e)}); check its permissions and "
                              f"that its filesystem is reachable") from None
        raise DataError(f"{name}: not a readable Parquet file ({one_line(e)}); "
                        + (f"give a dataset's directory or Parquet file ({IMPORT_HINT})" if single else
                           "re-import the dataset or remove the file")) from None


def _corrupt(exc):
    """Whether reading a footer failed on its bytes: no magic, cut short (ArrowInvalid), or
    a footer that does not parse (an OSError from the Thrift decoder)."""
    return isinstance(exc, pa.ArrowInvalid) or "thrift" in str(exc).lower()


def _yarnapp_meta(schema, name):
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
        if meta.get("shape") is not None:
            shape = [int(s) for s in meta["shape"]]
            if len(shape) != 3:
                raise ValueError("shape must be [C, H, W]")
        for k in ("mean", "std"):
            if meta.get(k) is not None and meta.get("shape") and len(meta[k]) != int(meta["shape"][0]):
                raise ValueError(f"one {k} per channel")
        return meta
    except (TypeError, ValueError, KeyError) as e:
        raise DataError(f"{name}: invalid yarnapp metadata in the Parquet schema ({one_line(e)}); "
                        f"re-import the dataset") from None


def hf_classes(schema, label):
    raw = (schema.metadata or {}).get(HF_KEY)
    if raw is None:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label]
        names = feature.get("names")
        return [str(n) for n in names] if feature.get("_type") == "ClassLabel" and names else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _kind(schema, columns, name, shape, meta, given=None):
    """(kind, shape) of the image column; DataError naming the file and column otherwise.
    given: {column: "int" | "float" | "str"} of the columns the file's Hive directories give."""
    where = "training.data.columns"
    given = given or {}
    if columns.image in given:
        raise DataError(f"{name}: the image column {columns.image!r} is a directory ({columns.image}=...), not "
                        f"a column of the file; name the column of images with {where}.image")
    for col, what in ((columns.image, "image"), (columns.label, "label")):
        if schema.get_field_index(col) < 0 and col not in given:
            raise DataError(f"{name}: no {what} column {col!r} (columns: {', '.join(schema.names)}); "
                            f"name it with {where}.{what}")
    if columns.class_name and schema.get_field_index(columns.class_name) < 0 and columns.class_name not in given:
        raise DataError(f"{name}: no class-name column {columns.class_name!r} (columns: "
                        f"{', '.join(schema.names)}), and no metadata naming the classes; fix {where}.class_name")
    t = schema.field(columns.image).type
    label_type = {"int": pa.int64(), "float": pa.float64(), "str": pa.string()}[given[columns.label]] \
        if columns.label in given \
        else schema.field(columns.label).type
    if not pa.types.is_integer(label_type):
        how = ("map each class name to an index 0..K-1 in an integer column, and name the column of "
               "names in training.data.columns.class_name" if pa.types.is_string(label_type)
               or pa.types.is_large_string(label_type) or pa.types.is_dictionary(label_type) else
               "cast them to integers" if pa.types.is_floating(label_type) else "write integer class indices")
        whose = f" (its directories, {columns.label}=...)" if columns.label in given else ""
        raise DataError(f"{name}: label column {columns.label!r}{whose} is {label_type}, expected integers "
                        f"(class indices 0..K-1); {how}")
    if pa.types.is_fixed_size_binary(t):
        if shape and meta.get("shape") and tuple(shape) != tuple(meta["shape"]):
            # (the pixels read in another geometry, and trained on without a word)
            raise DataError(f"{name}: training.data.shape {list(shape)} is not the shape its metadata gives, "
                            f"{list(meta['shape'])}; leave training.data.shape out (it is for files without "
                            f"yarnapp's metadata)")
        shape = tuple(shape) if shape else tuple(meta["shape"]) if meta.get("shape") else None
        if shape is None:
            raise DataError(f"{name}: column {columns.image!r} holds raw pixels ({t}) but no shape is known; "
                            f"give training.data.shape [C, H, W]")
        if int(np.prod(shape)) != t.byte_width:
            raise DataError(f"{name}: column {columns.image!r} is {t}, expected fixed_size_binary"
                            f"[{int(np.prod(shape))}] (C*H*W uint8 pixels for shape {list(shape)})")
        return RAW, tuple(int(s) for s in shape)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return ENCODED, None
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        return STRUCT, None
    raise DataError(f"{name}: column {columns.image!r} is {t}; expected encoded images (binary), a "
                    f"{{bytes, path}} struct (Hugging Face Image) or raw pixels (fixed_size_binary)")


def _column_bytes(rg, wanted):
    """(uncompressed, compressed) bytes of the columns under the names in `wanted`, and
    the (offset, length) of the whole row group in its file."""
    unc = comp = 0
    start, end = None, 0
    for i in range(rg.num_columns):
        c = rg.column(i)
        first = c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
        start = first if start is None else min(start, first)
        end = max(end, first + c.total_compressed_size)
        if c.path_in_schema.split(".")[0] in wanted:
            unc += c.total_uncompressed_size
            comp += c.total_compressed_size
    return unc, comp, (start or 0, end - (start or 0))


def row_group_span(rg):
    """(offset, length) of a row group in its file (as blocks_of records it in each Block)."""
    return _column_bytes(rg, ())[2]


def blocks_of(file, metadata, wanted, max_block_bytes=None):
    """The blocks of one file: its row groups, big ones cut into row ranges."""
    max_block_bytes = max_block_bytes or MAX_BLOCK_BYTES
    out = []
    for g in range(metadata.num_row_groups):
        rg = metadata.row_group(g)
        if rg.num_rows == 0:
            continue
        unc, comp, span = _column_bytes(rg, wanted)
        parts = max(1, min(rg.num_rows, -(-unc // max_block_bytes)))
        for p in range(parts):
            a, b = p * rg.num_rows // parts, (p + 1) * rg.num_rows // parts
            share = (b - a) / rg.num_rows
            out.append(Block(file, g, a, b - a, parts == 1, int(unc * share), int(comp * share), span))
    return out


def _statistics(metadata, column):
    """The footer's statistics of `column` (its path in the schema) in each row group
    (None where a row group has none)."""
    for g in range(metadata.num_row_groups):
        rg = metadata.row_group(g)
        for i in range(rg.num_columns):
            c = rg.column(i)
            if c.path_in_schema == column:
                yield c.statistics


def label_range(metadata, label):
    """(smallest, largest) label from a footer's statistics, or None when they are missing."""
    lo = hi = None
    for s in _statistics(metadata, label):
        if s is None or not s.has_min_max:
            return None
        lo = s.min if lo is None else min(lo, s.min)
        hi = s.max if hi is None else max(hi, s.max)
    return None if lo is None else (int(lo), int(hi))


def null_count(metadata, column):
    """Nulls in `column` by the footer's statistics (0 where they do not say)."""
    return sum(s.null_count for s in _statistics(metadata, column) if s is not None and s.has_null_count)


def inspect(uri, columns=None, shape=None, named=False):
    """The Layout of the dataset at `uri` (footers only: no data is read, except the label
    column when neither metadata nor statistics give the number of classes)."""
    f = read_footers(uri, columns or Columns(), shape, named)
    first = f.footers[0].schema.to_arrow_schema()
    blocks = [b for i, md in enumerate(f.footers) for b in blocks_of(i, md, wanted_columns(f.columns))]
    layout = Layout(uri, f.fs, f.paths, f.names, f.columns, f.kind, f.shape, f.meta, None, 0, blocks,
                    root=f.root, partitions=f.partitions)
    layout.classes, layout.num_classes = _classes(layout, first, f)
    log.info("%s: %d rows in %d files, %d blocks, %s images, %d classes, %.1f MB%s",
             uri, layout.rows, len(f.paths), len(blocks), f.kind, layout.num_classes, layout.nbytes / 1e6,
             f" (from column=value directories: {sorted(set().union(*f.partitions))})" if any(f.partitions) else "")
    return layout


def wanted_columns(columns):
    """The columns a rank reads."""
    return {columns.image, columns.label} | ({columns.class_name} if columns.class_name else set())


@dataclasses.dataclass
class Footers:
    """What read_footers found: every file's footer, and what they say together."""
    fs: object
    root: str                   # the dataset's directory in fs (the file's own, for one file)
    paths: List[str]
    names: List[str]            # how messages name each file
    footers: list
    meta: dict
    kind: str
    shape: Optional[tuple]
    columns: Columns
    partitions: List[dict]      # per file: the values of the wanted columns its Hive directories give

    def nulls(self, i, column):
        """Rows of file i whose `column` is null by its footer's statistics (a column its
        directories give has none: read_footers refuses a null there)."""
        return 0 if column in self.partitions[i] else null_count(self.footers[i], column)

    def labels(self, i):
        """(smallest, largest) label of file i, or None where not known without reading it."""
        part = self.partitions[i]
        if self.columns.label in part:      # an empty file's directory names no label of a row
            return (part[self.columns.label],) * 2 if self.footers[i].num_rows else None
        return label_range(self.footers[i], self.columns.label)


def _name(uri, path, root, file):
    """How messages name `file` of the dataset at `uri`: the URI of the file (a glob's
    files by the pattern's directory, `uri` less its last part)."""
    rel = posixpath.relpath(file, root)
    if root == path:
        return join(uri, rel)
    base, sep, query = split_query(uri)
    head, slash, _ = base.rstrip("/").rpartition("/")
    return (head + "/" if slash else "") + rel + sep + query


def read_footers(uri, columns, shape, named=False):
    """Footers: every file's footer, and the image column's kind, the same in every file;
    DataError for a dataset of no rows. `columns` less the class-name column where the
    dataset has none and its metadata (ours or Hugging Face's) names the classes, or
    `named`: the classes are named elsewhere (a test set, by its training set). A wanted
    column a file lacks may come from its Hive directories (label=3/...)."""
    fs, path = filesystem(uri)
    root, paths, partitions = list_files(uri, fs, path)
    names = [uri if p == path else _name(uri, path, root, p) for p in paths]
    with concurrent.futures.ThreadPoolExecutor(min(8, len(paths))) as pool:
        footers = list(pool.map(lambda i: _footer(fs, paths[i], names[i], single=paths[i] == path),
                                range(len(paths))))
    if not any(md.num_rows for md in footers):
        raise DataError(f"{uri}: the dataset has no rows; {IMPORT_HINT}")
    first = footers[0].schema.to_arrow_schema()
    meta = _yarnapp_meta(first, names[0])
    given = set(partitions[0]) - set(first.names)       # a column in the files wins over a directory's
    if columns.class_name and first.get_field_index(columns.class_name) < 0 and columns.class_name not in given \
            and (named or meta.get("num_classes") or hf_classes(first, columns.label)):
        # its metadata names the classes: the column is for datasets without (a training set
        # with it beside a test set imported by yarnapp, say)
        columns = dataclasses.replace(columns, class_name=None)
    wanted = wanted_columns(columns)
    partitions, odd = typed_labels([{k: v for k, v in part.items() if k in given and k in wanted}
                                    for part in partitions], columns.label, footers, names)
    for name, part, md in zip(names, partitions, footers):
        null = next((k for k, v in part.items() if v is None), None)
        if null is not None and md.num_rows:
            what = "a label" if null == columns.label else "a class name"
            raise DataError(f"{name}: {md.num_rows} row(s) without {what} (a null in its directory's name, "
                            f"{null}={HIVE_NULL} or {null}=); drop those rows, or give each {what}")
    kinds = {k: next((type(p[k]).__name__ for p in partitions if p.get(k) is not None), "int")
             for k in given & wanted}
    refuse_a_partition_itself(uri, columns, first, given)
    if odd:                                 # the first file whose directory's label is not an integer
        _kind(footers[odd].schema.to_arrow_schema(), columns, names[odd], shape, meta, kinds)
    kind, raw_shape = _kind(first, columns, names[0], shape, meta, kinds)
    image_type = first.field(columns.image).type
    for name, md in zip(names[1:], footers[1:]):
        schema = md.schema.to_arrow_schema()
        _kind(schema, columns, name, shape, meta, kinds)
        if schema.field(columns.image).type != image_type:
            raise DataError(f"{name}: column {columns.image!r} is {schema.field(columns.image).type}, "
                            f"{image_type} in {names[0]}; the directory mixes datasets")
    return Footers(fs, root, paths, names, footers, meta, kind, raw_shape, columns, partitions)


def _classes(layout, schema, found):
    meta, cols = layout.meta, layout.columns
    if meta.get("num_classes"):
        n = int(meta["num_classes"])
        return [str(c) for c in meta.get("classes") or range(n)], n
    hf = hf_classes(schema, cols.label)
    if hf:
        return hf, len(hf)
    if cols.class_name:
        return _names_from_column(layout)
    ranges = {}
    for i in range(len(found.paths)):
        if found.footers[i].num_rows:
            ranges[i] = found.labels(i)
            if ranges[i] is None:       # a file written without statistics: its labels read
                ranges[i] = read_label_range(layout.fs, layout.paths[i], layout.name(i), cols.label)
    if not ranges:
        return [], 0
    low = min(ranges, key=lambda i: ranges[i][0])
    if ranges[low][0] < 0:
        raise DataError(f"{layout.name(low)}: labels must be class indices >= 0, found {ranges[low][0]}")
    hi = max(r[1] for r in ranges.values())
    too_many(layout.uri, hi)
    return [str(i) for i in range(hi + 1)], hi + 1


def too_many(uri, largest):
    """DataError where the largest label makes more classes than a model has outputs for."""
    if largest >= MAX_CLASSES:
        raise DataError(f"{uri}: its labels go up to {largest}: labels are class indices 0..K-1 (at most "
                        f"{MAX_CLASSES:,} classes); write them so")


def read_column(layout, column, what):
    """One small column of the whole dataset as numpy (labels, class names); DataError
    naming the file where a row has none (a null `what`: a label became NaN, and then a
    bare "cannot convert float NaN to integer")."""
    out = []
    for i, path in enumerate(layout.paths):
        if layout.partitions and column in layout.partitions[i]:
            rows = sum(b.rows for b in layout.blocks if b.file == i)
            out.append(constant(layout.partitions[i][column], rows).to_numpy(zero_copy_only=False))
            continue
        out.append(read_file_column(layout.fs, path, layout.name(i), column, what).to_numpy(zero_copy_only=False))
    return np.concatenate(out) if out else np.zeros(0)


def read_label_range(fs, path, name, column):
    """(smallest, largest) label of one file (`name`: as the user named it), read from its
    label column: a file written without statistics (DataError for a null label)."""
    lo_hi = pc.min_max(read_file_column(fs, path, name, column, "label"))
    return int(lo_hi["min"].as_py()), int(lo_hi["max"].as_py())


def read_file_column(fs, path, name, column, what):
    """One column of one file (`name`: as the user named it) as a pyarrow ChunkedArray;
    DataError where it is corrupt, or where a row has no `what` (null)."""
    try:
        with fs.open_input_file(path) as f:
            values = pq.ParquetFile(f).read(columns=[column]).column(column)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{name}: corrupt Parquet data ({one_line(e)}); re-import the dataset") from None
    if values.null_count:
        raise DataError(f"{name}: {values.null_count} row(s) without a {what} (null in column {column!r}); drop "
                        f"those rows, or give each a {what}")
    return values


def _names_from_column(layout):
    cols = layout.columns
    labels = read_column(layout, cols.label, "label").astype(np.int64)
    given = read_column(layout, cols.class_name, "class name")
    if len(labels) and labels.min() < 0:
        raise DataError(f"{layout.uri}: labels must be class indices >= 0, found {labels.min()}")
    n = int(labels.max()) + 1 if len(labels) else 0
    classes = [str(i) for i in range(n)]
    seen = {}
    for lab, nm in zip(labels.tolist(), given.tolist()):
        if seen.setdefault(lab, nm) != nm:
            raise DataError(f"{layout.uri}: label {lab} has two class names, {seen[lab]!r} and {nm!r}; "
                            f"check training.data.columns.class_name")
    for lab, nm in seen.items():
        classes[lab] = str(nm)
    return classes, n
