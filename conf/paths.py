"""Paths and URIs in a job as pyarrow reads them, without pyarrow (conf imports no more than
what validating a job needs: a client environment may have no pyarrow)."""
import os


def normal(uri):
    """`uri` as pyarrow reads it: `~` and `~user` expanded (a literal `~` directory is a
    trap: `rm -rf ~` removes the home), `file:/path` (one slash, as pyarrow takes it) is
    `file:///path`, not a relative path named `file:`."""
    if uri.startswith("~"):
        return os.path.expanduser(uri)
    if uri.startswith("file:/") and not uri.startswith("file://"):
        return "file://" + uri[len("file:"):]
    return uri
