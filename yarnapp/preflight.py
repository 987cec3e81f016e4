"""What the client checks before anything starts: the job's datasets are there and readable.

A job whose data is missing, empty, not Parquet, or lacks its image and label columns
would start its containers only to fail in them. For a job of the built-in runner (the
one that reads `training.data`), the client reads every file's footer first (no rows:
training.data.formats.check, what each rank does at start) and refuses such a job in one
line naming the field. On YARN, a local path (one on the nodes' own disks) and a
filesystem the client cannot reach (no libhdfs here, a NameNode or DataNode only the
cluster sees) are left to the containers, which report them in one line too; an unknown
scheme is refused on both backends.
"""
import logging
import urllib.parse

from conf import BUILTIN_RUNNER

from .errors import YarnappError

log = logging.getLogger(__name__)


def check_data(job, where=None, on_cluster=False):
    """Raise YarnappError naming `where` and training.data.train/test when a dataset the
    job trains on cannot be opened from here (on_cluster: only a shared filesystem's URI
    that this client reaches is checked)."""
    data = job.training.data if job.training is not None else None
    if data is None or data.dataset or job.run.function != BUILTIN_RUNNER:
        return                  # own code reads what it likes; a user's dataset is theirs to open
    from training import fsutil
    from training.data import DataError
    from training.data.common import Unreachable
    from training.data.formats import Columns, check
    pre = f"{where}: " if where else ""
    unreachable = set()         # (scheme, host) already found out of reach: not tried again
    for split in ("train", "test"):
        uri = getattr(data, split)
        if not uri or (on_cluster and fsutil.is_local(uri)):
            continue
        u = urllib.parse.urlparse(uri)
        if (u.scheme, u.netloc) in unreachable:
            continue
        try:
            check(uri, Columns.of(data.columns), tuple(data.shape) if data.shape else None)
        except Unreachable as e:
            if not on_cluster:
                raise YarnappError(f"{pre}training.data.{split}: {e}") from None
            unreachable.add((u.scheme, u.netloc))
            log.warning("training.data.%s not checked before submitting: %s (the containers report it if they "
                        "cannot reach it either)", split, e)
        except DataError as e:
            raise YarnappError(f"{pre}training.data.{split}: {e}") from None
