"""`yarnapp clean`: removing finished applications of the local engine, and saying what
they left outside YARNAPP_HOME."""
import logging
import os
import time

import conf

from . import backends
from .errors import YarnappError

log = logging.getLogger("yarnapp.api")


def clean(apps=(), older_than=None, dry_run=False):
    """yarnapp.api.clean's work (its docstring says what it does)."""
    local = backends.get("local")
    apps = [apps] if isinstance(apps, str) else list(apps or ())
    if bool(apps) == (older_than is not None):
        raise YarnappError("yarnapp clean: give the applications to remove, or older_than (e.g. 7d; 0: every "
                           "finished one)")
    local.sweep_removed()
    listed = local.list()
    resumed_by = local.resumed_by(listed)
    if apps:
        chosen = []
        for app_id in dict.fromkeys(apps):
            try:
                local.check_finished(app_id, resumed_by)
            except YarnappError as e:
                raise YarnappError(f"{e}; nothing was removed") from None
            chosen.append(local.status(app_id))
    else:
        try:
            age = conf.units.parse_duration_s(older_than, zero=True)
        except ValueError:
            raise YarnappError(f"older_than {older_than!r}: expected a duration such as 12h or 7d (0: every "
                               "finished application)") from None
        chosen = []
        for a in listed:
            try:
                ended = local.ended(a["app_id"])
                if ended is not None and time.time() - ended >= age:
                    local.check_not_resumed(a["app_id"], resumed_by)
                    chosen.append(a)
            except YarnappError as e:        # removed meanwhile (another clean), or kept
                if a["app_id"] in resumed_by:
                    log.warning("kept %s", e)
    out = []
    for a in chosen:
        outside = _outside_the_home(local, a["app_id"])
        try:
            size = local.size(a["app_id"]) if dry_run else local.remove(a["app_id"], resumed_by)
        except YarnappError:
            if apps:
                raise
            continue                        # another clean took it meanwhile
        out.append((a["app_id"], a["name"], a["state"], size))
        for field, path in outside if not dry_run else ():     # (grew unseen: it said 0.0 MiB, 9 MB left)
            log.warning("left %s of %s: the job's own %s (remove it yourself when it is not needed)", path,
                        a["app_id"], field)
    return out


def _outside_the_home(local, app_id):
    """[(field, path)] of what application `app_id` wrote outside YARNAPP_HOME, on this
    machine: its checkpoints under the job's checkpoint.uri, its TensorBoard run under
    tensorboard.logdir (clean leaves them)."""
    from training import fsutil
    try:
        job = local.job_of(app_id)
    except YarnappError:
        return []
    found = []
    for field, uri in (("checkpoint.uri", job and job.checkpoint.uri),
                       ("tensorboard.logdir", job and job.tensorboard.logdir)):
        if uri and fsutil.is_local(uri):
            path = os.path.join(fsutil.local_path(uri), app_id)
            if os.path.isdir(path):
                found.append((field, path))
    return found
