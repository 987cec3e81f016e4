"""What the client checks before anything starts: the job's datasets are there and readable.

A job whose data is missing, is not Parquet, or lacks its image and label columns would
start its containers only to fail in them. The client reads every file's footer first
(no rows: training.data.formats.check, what each rank does at start) and refuses such a
job in one line naming the field. On YARN, a URI the client cannot reach (no libhdfs
here, a filesystem only the cluster sees) and a local path (one on the nodes' own disks)
are left to the containers, which report them in one line too.
"""
import logging

from .errors import YarnappError

log = logging.getLogger(__name__)


def check_data(job, where="job", on_cluster=False):
    """Raise YarnappError naming `where` and training.data.train/test when a dataset the
    job trains on cannot be opened from here (on_cluster: only a shared filesystem's URI
    that this client reaches is checked)."""
    data = job.training.data if job.training is not None else None
    if data is None or data.dataset:
        return
    from training import fsutil
    from training.data import DataError
    from training.data.common import Unreachable
    from training.data.formats import Columns, check
    for split in ("train", "test"):
        uri = getattr(data, split)
        if not uri or (on_cluster and fsutil.is_local(uri)):
            continue
        try:
            check(uri, Columns.of(data.columns), tuple(data.shape) if data.shape else None)
        except Unreachable as e:
            if not on_cluster:
                raise YarnappError(f"{where}: training.data.{split}: {e}") from None
            log.warning("training.data.%s not checked before submitting: %s (the containers report it if they "
                        "cannot reach it either)", split, e)
        except DataError as e:
            raise YarnappError(f"{where}: training.data.{split}: {e}") from None
