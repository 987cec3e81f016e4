"""The few filesystem operations checkpoints and TensorBoard need, on any pyarrow URI.

A plain path is local; `file://`, `hdfs://`, `s3://`... go through
`pyarrow.fs.FileSystem.from_uri`. This is the one adapter around pyarrow's
filesystems for writing (training.data has the reading side).
"""
import io
import os

import pyarrow.fs as pafs


def resolve(uri):
    """(filesystem, path) for a URI or local path."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    return pafs.FileSystem.from_uri(uri)


def is_local(uri):
    return "://" not in uri or uri.startswith("file://")


def local_path(uri):
    return uri[len("file://"):] if uri.startswith("file://") else uri


def write_bytes(fs, path, data):
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(fs, path):
    with fs.open_input_stream(path) as f:
        return f.read()


def listdir(fs, path):
    sel = pafs.FileSelector(path, allow_not_found=True)
    return sorted(info.base_name for info in fs.get_file_info(sel))


def exists(fs, path):
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def torch_bytes(obj):
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_load(data):
    import torch
    return torch.load(io.BytesIO(data), weights_only=False)
