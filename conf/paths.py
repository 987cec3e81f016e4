"""Paths and URIs in a job as pyarrow reads them, without pyarrow (conf imports no more than
what validating a job needs: a client environment may have no pyarrow)."""
import os
import urllib.parse


def normal(uri):
    """`uri` as pyarrow reads it: `~` and `~user` expanded (a literal `~` directory is a
    trap: `rm -rf ~` removes the home), `file:/path` (one slash, as pyarrow takes it) is
    `file:///path`, not a relative path named `file:`."""
    if uri.startswith("~"):
        return os.path.expanduser(uri)
    if uri.startswith("file:/") and not uri.startswith("file://"):
        return "file://" + uri[len("file:"):]
    return uri


def is_local(uri):
    uri = normal(uri)
    return "://" not in uri or uri.startswith("file://")


def local_path(uri):
    """The local path of a plain path or a file:// URI, its %-escapes decoded as pyarrow
    decodes them (file:///tmp/a%20b is /tmp/a b)."""
    uri = normal(uri)
    return urllib.parse.unquote(uri[len("file://"):]) if uri.startswith("file://") else uri
