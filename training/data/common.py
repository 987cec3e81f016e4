"""What every module of the data package shares: its error, and opening URIs.

Every URI is opened through training.fsutil.resolve (the one adapter around pyarrow's
filesystems); here its failures become a DataError of one line naming the URI and what
to do.
"""
import re

import pyarrow as pa
import pyarrow.fs as pafs

from conf.errors import YarnappError
from training import fsutil

IMPORT_HINT = "import one with `yarnapp data import KIND URI`"
MAX_CLASSES = 1_000_000     # a label past this is a mistake (a row id, a hash), not a class index


class DataError(YarnappError, ValueError):
    """A dataset that cannot be read or written. str() is one line naming the URI or file."""
    repeats = False             # found in the files' content: a restart reads it again


class BadData(DataError):
    """What a rank found in the content of the data (a page whose checksum fails, an image
    that does not decode, a label out of range): a restart meets it again at the same step."""
    repeats = True


class DataChanged(BadData):
    """A file of the dataset changed (rewritten, replaced, removed) while the job ran: its
    epochs were planned on the files as they were, and its checkpoints stand for places in
    them, so a restart, planning on the new files, would resume at other rows (or be refused
    for another number of rows, in words about checkpoint.resume the user never set)."""
    certain = ("the dataset changed under the job, which a restart would not undo, so it was not retried")
    CHANGED = ("; a dataset must not change under a running job: put it back as it was to resume from the job's "
               "checkpoints, or train afresh on the new data (checkpoint.resume: never)")


class Unreachable(DataError):
    """A URI whose filesystem cannot be opened or reached from here (another machine, a
    cluster's container, may still reach it)."""


def one_line(exc):
    """The first line of an exception's message (arrow errors can span a page). urllib3's
    "Max retries exceeded with url: ... (Caused by NewConnectionError(...: [Errno 111]
    Connection refused'))" (WebHDFS) is said by its host and its cause: cut at 200
    characters, the cause was lost mid-phrase."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    retries = re.match(r"(\w+ConnectionPool\(host=[^)]*\)): Max retries exceeded", line)
    if retries:
        cause = (re.search(r"\[Errno -?\d+\] ([^'\"()]+)", line)              # the socket's own words
                 or re.search(r"Caused by \w+\(.*['\"]([^'\"]*[a-z][^'\"]*)['\"]\)+$", line)    # its message
                 or re.search(r"Caused by (\w+)", line))
        said = cause.group(1).split("): ")[-1] if cause else "no connection"
        return f"{retries.group(1)}: {said}"
    return line if len(line) <= 200 else line[:197] + "..."


# What a filesystem raises when it cannot be reached or read from here: pyarrow's I/O
# errors (OSError), and fsspec's WebHDFS server errors (RuntimeError, ValueError: a standby
# NameNode, a DataNode only the cluster resolves).
IO_ERRORS = (pa.ArrowException, OSError, RuntimeError, ValueError)


def filesystem(uri):
    """(pyarrow filesystem, path inside it) for a URI or a plain local path. A URI that
    names no filesystem (an unknown scheme) is a DataError; one whose filesystem cannot be
    set up or reached from here (no libhdfs, no network) is Unreachable."""
    try:
        return fsutil.resolve(uri)
    except (pa.ArrowInvalid, fsutil.URIError) as e:
        raise DataError(f"cannot open {uri}: {one_line(e)}; check the scheme (file://, hdfs://, webhdfs://, "
                        f"s3://) and the URI") from None
    except IO_ERRORS as e:
        hint = ("hdfs:// needs Java and libhdfs here (JAVA_HOME, HADOOP_HOME, CLASSPATH) and a reachable "
                "namenode; without libhdfs, give the same path through the NameNode's WebHDFS: "
                "webhdfs://NAMENODE:HTTP-PORT/path (`yarnapp hadoop status` gives the local one's)"
                if uri.startswith(("hdfs://", "viewfs://")) else "check that its filesystem is reachable from here")
        raise Unreachable(f"cannot open {uri}: {one_line(e)}; {hint}") from None


def split_query(uri):
    """(base, "?", query) of a URI with a query string (s3://b/x?region=r); (uri, "", "")
    otherwise: a plain path's "?" is its own."""
    return uri.partition("?") if "://" in uri else (uri, "", "")


def join(uri, name):
    """`uri`/`name`, keeping a URI's query string (s3://b/x?region=r) at the end."""
    base, sep, query = split_query(uri)
    return base.rstrip("/") + "/" + name + sep + query


def info(fs, path, uri):
    try:
        return fs.get_file_info(path)
    except IO_ERRORS as e:
        raise Unreachable(f"cannot reach {uri}: {one_line(e)}; check the URI and that its "
                        f"filesystem is up") from None


def exists(fs, path, uri):
    return info(fs, path, uri).type != pafs.FileType.NotFound
