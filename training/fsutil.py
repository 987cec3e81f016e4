"""The few filesystem operations checkpoints and TensorBoard need, on any pyarrow URI.

`resolve(uri)` is the ONE place a URI becomes a filesystem (data, checkpoints,
TensorBoard and the YARN backend all open URIs through it):

    a plain path, file://     the local filesystem
    webhdfs://HOST:PORT/path  HDFS through the NameNode's WebHDFS REST API (fsspec's
                              `webhdfs`, wrapped as a pyarrow filesystem); no libhdfs
                              needed, as user $HADOOP_USER_NAME, else the login user
    hdfs://, s3://, gs://...  pyarrow's own (`pyarrow.fs.FileSystem.from_uri`; hdfs://
                              is libhdfs, which needs Java and Hadoop's native library;
                              gs:// retries for GCS_RETRY_S, not google-cloud-cpp's minutes)

On WebHDFS a rename is atomic and refused when the destination exists (FileExistsError),
which the checkpoints' never-overwrite rule relies on. That is HDFS's rename2
(`renameoptions=NONE`): HDFS's plain rename, which fsspec's `mv` sends, would move a
directory INTO an existing destination directory and report nothing.
"""
import functools
import getpass
import io
import os
import urllib.parse

import pyarrow.fs as pafs

from conf.errors import YarnappError
from conf import paths


normal, is_local, local_path = paths.normal, paths.is_local, paths.local_path   # (conf.paths: no pyarrow)
GCS_RETRY_S = 20    # how long a gs:// URI's requests are retried, unless its query sets retry_limit_seconds


class URIError(YarnappError, ValueError):
    """A URI that names no filesystem we can open (a ValueError too, as pyarrow's are)."""


NAMENODE_PORTS = {"webhdfs": 9870, "hdfs": 8020}      # a NameNode's, where a URI names none (Hadoop 3's)


def resolve(uri):
    """(filesystem, path) for a URI or local path."""
    uri = normal(uri)
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    if uri.startswith("webhdfs://"):
        u = urllib.parse.urlparse(uri)
        if not u.hostname:
            raise URIError(f"{uri}: a webhdfs URI names the NameNode's HTTP address: webhdfs://HOST:PORT/path")
        return _webhdfs(u.hostname, u.port or NAMENODE_PORTS["webhdfs"], hdfs_user()), u.path or "/"
    if uri.startswith(("gs://", "gcs://")) and "retry_limit_seconds=" not in uri:
        # google-cloud-cpp retries for many minutes by default, deaf to Ctrl-C: an unreachable
        # bucket (no credentials, no network) hung submit; this fails it in ~2x the limit
        uri += ("&" if "?" in uri else "?") + f"retry_limit_seconds={GCS_RETRY_S}"
    return pafs.FileSystem.from_uri(uri)


def hdfs_user():
    """Who we are to HDFS with simple authentication (YARN sets USER in containers)."""
    return os.environ.get("HADOOP_USER_NAME") or getpass.getuser()


# WebHDFS requests' (connect, read) timeouts in seconds: fsspec gives none, and a frozen NameNode
# hung `yarnapp submit` and `data import` silently for ever (a read waits this long for a byte).
WEBHDFS_TIMEOUT = (10.0, 60.0)


@functools.lru_cache(maxsize=None)
def _webhdfs(host, port, user):
    from fsspec.implementations.webhdfs import WebHDFS

    class _HDFSRename(WebHDFS):
        def mv(self, path1, path2, **kwargs):
            # renameoptions=NONE is HDFS's rename2: the destination must not exist. (Plain
            # RENAME would move a directory INTO an existing destination directory.)
            try:
                self._call("RENAME", method="put", path=path1, destination=path2, renameoptions="NONE")
            except RuntimeError as e:
                if "exists" in str(e):
                    raise FileExistsError(f"HDFS refused to rename {path1} onto {path2}, which exists") from None
                raise

    fs = _HDFSRename(host, port=port, user=user)
    request = fs.session.request        # (its get/put/post call it too)
    fs.session.request = lambda *a, **k: request(*a, **{"timeout": WEBHDFS_TIMEOUT, **k})
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def write_bytes(fs, path, data):
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(fs, path):
    with fs.open_input_stream(path) as f:
        return f.read()


def listdir(fs, path):
    """The names in a directory ([] where it does not exist); an error where its filesystem
    cannot be reached. (pyarrow's fsspec handler answers a listing of a WebHDFS out of reach
    with [], as for a directory not there: a restart while the NameNode was down found no
    checkpoint, and could have trained from step 0.)"""
    sel = pafs.FileSelector(path, allow_not_found=True)
    names = sorted(info.base_name for info in fs.get_file_info(sel))
    if not names:
        fs.get_file_info(path)      # raises where unreachable; NotFound otherwise
    return names


def exists(fs, path):
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def torch_bytes(obj):
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_load(data):
    import torch
    # On the CPU first: a checkpoint a GPU rank wrote resumes on CPU ranks too; each
    # strategy copies the tensors into its model wherever that lives.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


class ChecksumError(ValueError):
    """A saved file whose bytes changed after it was written (a disk's or a hand's fault)."""


def check_crcs(file):
    """Raise ChecksumError where a torch.save file (a zip, `file` a path or a binary file
    object) holds a record whose bytes do not match its CRC-32: such a file still loads,
    its tensors silently other than saved. ~2 GB/s; a file that is no zip is left alone."""
    import zipfile
    if not zipfile.is_zipfile(file):
        return
    with zipfile.ZipFile(file) as z:
        try:
            bad = z.testzip()
        except zipfile.BadZipFile as e:
            raise ChecksumError(str(e)) from None
    if bad:
        raise ChecksumError(f"its record {bad} does not match its CRC-32 (its bytes changed after it was written)")


def torch_load_file(fs, path):
    """torch_load of the file at `path`, its tensors mapped from a local file rather than
    read into memory: a rank resuming holds its model and optimizer already, and the
    file's bytes and the tensors made of them came on top (a 235 MB checkpoint took a
    rank that trained in 715 MiB to its 1 GiB limit at every restart). A remote file is
    first streamed to a local one in the working directory (a container's local disk;
    /tmp may be memory), unlinked once mapped. Mapped pages are the file's, which the
    kernel can drop under pressure, until a tensor is written. Where this fails on this
    side (no room for the copy, a filesystem that does not map), the file is read into
    memory as before: only a file that does not load that way either is unreadable.
    Its records' CRC-32s are checked first (check_crcs: ChecksumError)."""
    import shutil
    import tempfile

    import torch
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            check_crcs(path)
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        where = os.getcwd() if os.access(os.getcwd(), os.W_OK) else None
        with tempfile.NamedTemporaryFile(prefix=".yarnapp-checkpoint-", suffix=".pt", dir=where) as tmp:
            with fs.open_input_stream(path) as src:
                shutil.copyfileobj(src, tmp, 8 << 20)
            tmp.flush()
            check_crcs(tmp.name)
            return torch.load(tmp.name, map_location="cpu", weights_only=False, mmap=True)
    except ChecksumError:
        raise
    except Exception:  # noqa: BLE001 - read as before; its error, if any, is the file's
        data = read_bytes(fs, path)
        check_crcs(io.BytesIO(data))
        return torch_load(data)
