"""Which files make a dataset at a URI (training.data.formats reads their footers):

- a file: itself;
- a directory: its `.parquet` (and Impala's `.parq`) files (names starting with "." or
  "_" are not data: temporary directories, _SUCCESS markers, caches), else its files
  named as Hive, MapReduce and Spark name theirs in a table (HIVE_NAME: 000000_0, no
  extension);
- Spark's or Hive's partitionBy output: a directory whose subdirectories are
  `column=value`, as many levels deep as written; every shard below them, with the values
  its directories give (a column of every row of it where the files leave it out);
- a pattern in the last part of the path (the Hugging Face hub's data/train-*.parquet).

What would read as a dataset but is not one is refused in one line (DataError): two
splits' files in one directory, shards beside partitionBy's directories or under other
directories, subdirectories that are separate datasets, one partition given alone
(refuse_a_partition_itself). Labels from directories are typed by typed_labels.
"""
import fnmatch
import posixpath
import re
import urllib.parse

import pyarrow.fs as pafs

from .common import IMPORT_HINT, IO_ERRORS, MAX_CLASSES, DataError, Unreachable, info, join, one_line, split_query

HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"     # Hive's and Spark's directory name for a null value


def is_shard(entry):
    """Whether a directory entry (pyarrow FileInfo) is one of a dataset's Parquet shards."""
    return (entry.type == pafs.FileType.File and entry.base_name.endswith((".parquet", ".parq"))
            and not entry.base_name.startswith((".", "_")))


# 000000_0, 000000_0_copy_1 (Hive), part-r-00000 (MapReduce), part-00000-<uuid>-c000 (Spark into a Hive table)
HIVE_NAME = re.compile(r"^(\d+_\d+(_copy_\d+)?|part-([mr]-)?\d+(-[0-9a-f-]+(-c\d+)?)?)$")


def _hive_file(entry):
    """A file named as Hive and MapReduce name their output (000000_0, part-00000, no
    extension). Read as a shard where a directory holds no .parquet files."""
    return entry.type == pafs.FileType.File and bool(HIVE_NAME.match(entry.base_name))


def _shards(entries):
    """The shards among one directory's entries: its .parquet files, else its Hive-named files."""
    return [e for e in entries if is_shard(e)] or [e for e in entries if _hive_file(e)]


GLOB_CHARS = "*?["      # in a URI with a scheme only "*": "?" starts its query, "[" does not parse
# Hugging Face's data/train-00000-of-00002.parquet
SPLIT_NAME = re.compile(r"^(train|test|validation|valid|val|eval)[-_.]")


def list_files(uri, fs, path):
    """(root, paths, partitions): the directory the dataset's files are named from, its
    Parquet shards, sorted, and for each the values its Hive-style directories give ({}
    for a shard of the directory itself).
    - a file: itself;
    - a directory: its .parquet files (else its files named as Hive names them, 000000_0);
      with none of its own, Spark's or Hive's partitionBy output where its subdirectories
      are `column=value` (as many levels deep as written; `column` then reads as a column
      of every row below);
    - a glob in the last part of the path (data/train-*.parquet): the files it matches.
    Anything else is refused in one line: subdirectories that are separate datasets, shards
    beside partitionBy's directories, a directory of two splits' files (train-*, test-*)."""
    found = info(fs, path, uri)
    if found.type == pafs.FileType.NotFound:
        if any(c in posixpath.basename(path.rstrip("/")) for c in GLOB_CHARS):
            return _glob(uri, fs, path)
        raise DataError(f"no dataset at {uri}: it does not exist; {IMPORT_HINT}")
    if found.type == pafs.FileType.File:
        return posixpath.dirname(path), [path], [{}]
    entries = _listing(fs, path, uri)
    files = sorted(e.path for e in entries if is_shard(e))
    dirs = [e for e in entries if e.type == pafs.FileType.Directory and not e.base_name.startswith((".", "_"))]
    hive = [d for d in dirs if hive_key(d.base_name)]
    if files:
        nested = _nested_shard(fs, hive, deep=True)
        if nested:
            raise DataError(f"{uri}: holds .parquet files ({posixpath.basename(files[0])}) beside column=value "
                            f"directories of them ({posixpath.relpath(nested, path)}), as no partitionBy writes; "
                            f"move one or the other out")
        _refuse_splits(uri, files)
        return path, files, [{}] * len(files)
    if hive:
        return (path,) + _partitioned(uri, fs, path)
    files = sorted(e.path for e in entries if _hive_file(e))        # a Hive table's 000000_0
    if files:
        return path, files, [{}] * len(files)
    nested = _nested_shard(fs, dirs, deep=True)
    if nested:
        raise DataError(f"no dataset at {uri}: the directory holds no .parquet files of its own, but its "
                        f"subdirectories do ({posixpath.relpath(nested, path)}): point training.data at one "
                        f"directory of .parquet files (one directory per dataset; partitionBy's column=value "
                        f"directories are read as a column)")
    raise DataError(f"no dataset at {uri}: the directory holds no .parquet shards; {IMPORT_HINT}")


def _glob(uri, fs, path):
    parent, pattern = posixpath.split(path.rstrip("/"))
    if any(c in parent for c in GLOB_CHARS):
        raise DataError(f"{uri}: a pattern works in the last part of the path only, as in data/train-*.parquet")
    entries = [e for e in _listing(fs, parent or ".", uri) if e.type == pafs.FileType.File
               and not e.base_name.startswith((".", "_")) and fnmatch.fnmatchcase(e.base_name, pattern)]
    if not entries:
        raise DataError(f"no dataset at {uri}: no file matches {pattern!r}; {IMPORT_HINT}")
    files = sorted(e.path for e in entries)
    _refuse_splits(split_query(uri)[0].rstrip("/").rpartition("/")[0] or ".", files)
    return parent, files, [{}] * len(entries)


def _refuse_splits(uri, files):
    """A directory of two splits' files (the Hugging Face hub's data/: train-00000-of-00001.parquet
    beside test-00000-of-00001.parquet) read as one dataset would train on the test set."""
    splits = {}
    for f in files:
        m = SPLIT_NAME.match(posixpath.basename(f))
        if m:
            splits.setdefault(m.group(1), posixpath.basename(f))
    if len(splits) > 1:
        patterns = " and ".join(join(uri, f"{split}*.parquet") for split in sorted(splits, key=lambda k: k != "train"))
        raise DataError(f"{uri}: its files are of {len(splits)} splits ({', '.join(splits.values())}), read as one "
                        f"dataset they would mix them; give each split's files with a pattern: {patterns}")


def _nested_shard(fs, dirs, deep=False):
    """A shard in one of `dirs` (one level down; deep: up to three, for a message), or None:
    at most 16 directories are listed (a bucket's root may hold many)."""
    queue, listed = [(d.path, 1) for d in dirs], 0
    while queue and listed < 16:
        path, depth = queue.pop(0)
        try:
            inner = fs.get_file_info(pafs.FileSelector(path, recursive=False))
        except IO_ERRORS:
            continue
        listed += 1
        found = next((e.path for e in inner if is_shard(e)), None)
        if found:
            return found
        if deep and depth < 3:
            queue += [(e.path, depth + 1) for e in inner if e.type == pafs.FileType.Directory
                      and not e.base_name.startswith((".", "_"))]
    return None


def _listing(fs, path, uri, recursive=False):
    try:
        return fs.get_file_info(pafs.FileSelector(path, recursive=recursive))
    except IO_ERRORS as e:
        raise Unreachable(f"cannot list {uri}: {one_line(e)}") from None


def hive_key(name):
    """The column of a Hive-style directory name `column=value`, or None."""
    key, eq, _ = name.partition("=")
    return key if eq and key and not name.startswith((".", "_")) else None


def _partitioned(uri, fs, path):
    """(paths, partitions) of partitionBy output under `path`: every shard below
    `column=value` directories, the same columns on every path; the values as written
    (URL-escapes decoded), Hive's __HIVE_DEFAULT_PARTITION__ (and an empty value) None (null). What a column's
    values mean (a label's integers) is training.data.formats'."""
    by_dir = {}
    hidden = lambda p: any(c.startswith((".", "_")) for c in p.split("/"))     # noqa: E731
    for e in _listing(fs, path, uri, recursive=True):
        rel = posixpath.relpath(e.path, path)
        if e.type == pafs.FileType.File and not hidden(rel):
            by_dir.setdefault(posixpath.dirname(rel), []).append(e)
    files, raw = [], []
    for d in sorted(by_dir):
        if not d:               # the directory's own files: none is a .parquet shard (list_files)
            continue
        parts = d.split("/")
        if not all(hive_key(p) for p in parts):
            stray = _shards(by_dir[d])
            if stray:
                raise DataError(f"{join(uri, posixpath.relpath(stray[0].path, path))}: not under column=value "
                                f"directories as the rest of the dataset (partitionBy's output); move "
                                f"{join(uri, d)} out of {uri}")
            continue
        for e in sorted(_shards(by_dir[d]), key=lambda e: e.path):
            files.append(e.path)
            raw.append({p.partition("=")[0]: urllib.parse.unquote(p.partition("=")[2]) for p in parts})
    if not files:
        raise DataError(f"no dataset at {uri}: its column=value subdirectories hold no .parquet shards; {IMPORT_HINT}")
    keys = set(raw[0])
    odd = next((i for i, r in enumerate(raw) if set(r) != keys), None)
    if odd is not None:
        raise DataError(f"{join(uri, posixpath.relpath(files[odd], path))}: its directories give "
                        f"{sorted(raw[odd])}, the first file's {sorted(keys)}; the directory mixes datasets")
    return files, [{k: None if v in (HIVE_NULL, "") else v for k, v in r.items()} for r in raw]


def refuse_a_partition_itself(uri, columns, schema, given):
    """One partition of partitionBy's output given as the dataset (.../label=3): its files
    hold no label column, the directory's name does."""
    if schema.get_field_index(columns.label) >= 0 or columns.label in given:
        return
    base, sep, query = split_query(uri)
    parts = base.rstrip("/").split("/")
    at = next((i for i in reversed(range(len(parts))) if hive_key(parts[i]) == columns.label), None)
    if at is not None:
        raise DataError(f"{uri}: is one partition ({parts[at]}) of partitionBy's output, whose files hold no label "
                        f"column; give the directory above it ({_parent(parts[:at]) + sep + query}), whose "
                        f"column=value directories give the labels")


def _parent(parts):
    """The directory of path `parts` (a URI's or a path's, split at "/"), as a person writes it."""
    up = "/".join(parts)
    if not up:
        return "/" if parts else "."        # parts [""]: the root of a plain path
    return up + "/" if up.endswith(":/") or up.endswith("//") else up     # file:/// and s3://b/ keep their slashes


INT_VALUE = re.compile(r"^-?[0-9]+$")
FLOAT_VALUE = re.compile(r"^-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")


def typed_labels(partitions, label, footers, names):
    """Labels from directories as numbers: ints where every one of a file with rows is an
    integer, floats where every one is a number (refused by formats' _kind, with how to fix them);
    else left strings, and refused by formats' _kind naming the first file whose label is not an
    integer (its index is returned, else 0). An empty file's directory names no label.
    (Class names and other columns stay as written: cname=007 is '007'.)"""
    partitions = [p if md.num_rows else {k: v for k, v in p.items() if k != label}
                  for p, md in zip(partitions, footers)]
    values = [(i, p[label]) for i, p in enumerate(partitions) if p.get(label) is not None]
    if not values:
        return partitions, 0
    odd = next((i for i, v in values if not INT_VALUE.match(v)), None)
    if odd is None:
        cast = int
        big = next((i for i, v in values if int(v) >= MAX_CLASSES), None)
        if big is not None:
            raise DataError(f"{names[big]}: its directory gives label {partitions[big][label]}: labels are class "
                            f"indices 0..K-1 (at most {MAX_CLASSES:,} classes); write them so")
    elif all(FLOAT_VALUE.match(v) for _, v in values):
        cast = float
    else:
        return partitions, odd
    return [{k: cast(v) if k == label and v is not None else v for k, v in p.items()} for p in partitions], odd or 0
