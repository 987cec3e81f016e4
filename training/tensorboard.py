"""TensorBoard event files for a run, written live (flushed as they are logged).

Rank 0 writes; the run appears as `<logdir>/<app_id>` so runs of one experiment
sit side by side. Every generation's writer starts with a session start at the step it
begins from (purge_step): TensorBoard drops what earlier writers logged from that step on,
so curves continue without duplicated steps after a restart. (TensorBoard's own loader,
the one `--load_fast=false` and `yarnapp tensorboard` use, takes the first start of a run
for its beginning and purges at the later ones only: the first generation writes one
too.) A logdir that is not local (hdfs://, s3://...) is written to a local cache and
copied up every `sync_every` seconds and at the end. Own code (a script, a function, a
loop on training.dist) gets a `ReportLog` instead: the numbers rank 0 reports.
"""
import logging
import math
import os
import shutil
import tempfile
import threading
import time

import pyarrow.fs as pafs

from . import fsutil

log = logging.getLogger(__name__)
ROTATE_BYTES = 4 * 2**20        # a remote logdir's event file is continued in a new one past this size
CONTINUE_MAX_BYTES = 256 * 2**20    # a resumed application's event files copied, at most


class _Scalars:
    """Scalars only, through tensorboard's own event writer: no torch (own code may not load
    it, and torch.utils.tensorboard costs a process ~450 MiB more than this)."""

    def __init__(self, logdir, purge_step=None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        os.makedirs(logdir, exist_ok=True)
        self.events = EventFileWriter(logdir, flush_secs=1)
        if purge_step is not None:          # as SummaryWriter(purge_step=) writes it
            self.events.add_event(Event(wall_time=time.time(), step=int(purge_step),
                                        session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag, value, step):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        self.events.add_event(Event(wall_time=time.time(), step=int(step), summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=float(value))])))

    def flush(self):
        self.events.flush()

    def close(self):
        self.events.close()


class TBLogger:
    def __init__(self, logdir, run_name, purge_step=None, sync_every=5.0, hparams=None, scalars_only=False,
                 scratch=None, continue_from=None):
        """A remote logdir (hdfs://...) is written in a local copy, synced every `sync_every`
        seconds: under `scratch` (default: the working directory, where writable; a rank's is its
        container's, which YARN removes with the container: the system's temporary directory was
        left a copy by every YARN application), removed at close. continue_from: the run
        directory of the application this one resumed, whose event files start this run's (once):
        its curves go on from them, as after a restart."""
        self.remote = None if fsutil.is_local(logdir) else logdir
        if scratch is None and os.access(os.getcwd(), os.W_OK):
            scratch = os.getcwd()
        self.staging = None if self.remote is None else tempfile.mkdtemp(prefix=".yarnapp-tb-", dir=scratch)
        self.local_dir = os.path.join(self.staging or fsutil.local_path(logdir), run_name)
        self.run_name = run_name
        self.scalars_only = scalars_only
        if continue_from and not (os.path.isdir(self.local_dir) and os.listdir(self.local_dir)):
            self._continue(continue_from)
        self.writer = self._writer(purge_step)
        # (remote) what each file was when copied up; where the writer's file started
        self._synced, self._started_at = {}, self._size() if self.remote else 0
        self._second = int(time.time())
        self.hparams = hparams or {}
        if self.hparams:
            self.writer.add_text("job", "\n".join(f"    {k}: {v}" for k, v in self.hparams.items()), 0)
        self._stop = threading.Event()
        self._thread = None
        if self.remote:
            self._thread = threading.Thread(target=self._sync_loop, args=(sync_every,), daemon=True)
            self._thread.start()

    def _continue(self, run_dir):
        """This run's files start as `run_dir`'s: hard links on this machine (no copy, and
        the other application's `clean` leaves them), else copies, up to CONTINUE_MAX_BYTES
        (a copy is rank 0's setup, before its first heartbeat)."""
        try:
            fs, path = fsutil.resolve(run_dir)
            files = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
                     if i.type == pafs.FileType.File]
            if sum(i.size for i in files) > CONTINUE_MAX_BYTES:
                log.warning("TensorBoard: the resumed application's curves (%s) are not continued: %.0f MiB of "
                            "event files, over %d MiB", run_dir, sum(i.size for i in files) / 2**20,
                            CONTINUE_MAX_BYTES // 2**20)
                return
            for i in files:
                target = os.path.join(self.local_dir, os.path.relpath(i.path, path))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                try:
                    if not isinstance(fs, pafs.LocalFileSystem):
                        raise OSError("not on this machine")
                    os.link(i.path, target)     # (a local logdir's)
                except OSError:
                    pafs.copy_files(i.path, target, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        except Exception as e:  # noqa: BLE001 - the curves start at the resumed step instead
            log.warning("TensorBoard: the resumed application's curves (%s) are not continued: %s", run_dir, e)

    def _writer(self, purge_step=None):
        if self.scalars_only:
            return _Scalars(self.local_dir, purge_step)
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter(self.local_dir, purge_step=purge_step, flush_secs=1)

    def scalars(self, step, values, prefix=""):
        for k, v in values.items():
            if v is not None:
                self.writer.add_scalar(prefix + k, float(v), step)
        self.writer.flush()
        if self.remote and self._size() - self._started_at > ROTATE_BYTES and int(time.time()) > self._second:
            # (not twice in a second: files are named by the second they start, then a counter,
            # and TensorBoard reads them in the order of their names)
            # A remote file is copied whole (HDFS and object stores do not take a part): a new
            # event file every ROTATE_BYTES, so each sync copies at most that much again, and a
            # day's run is not uploaded whole every few seconds. TensorBoard reads them in turn.
            self.writer.close()
            self.writer = self._writer()
            self._started_at, self._second = self._size(), int(time.time())

    def _files(self):
        """{path relative to the run's directory: (size, mtime)} of the files written."""
        out = {}
        for d, _, names in os.walk(self.local_dir):
            for n in names:
                st = os.stat(os.path.join(d, n))
                out[os.path.relpath(os.path.join(d, n), self.local_dir)] = (st.st_size, st.st_mtime_ns)
        return out

    def _size(self):
        return sum(size for size, _ in self._files().values())

    def _sync(self):
        """Copy up the files that changed since the last sync (an event file done with, once)."""
        fs, path = fsutil.resolve(self.remote)
        dest = f"{path.rstrip('/')}/{self.run_name}"
        files = self._files()
        for rel, seen in sorted(files.items()):
            if self._synced.get(rel) != seen:
                target = f"{dest}/{rel}"
                fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
                pafs.copy_files(os.path.join(self.local_dir, rel), target,
                                source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
                self._synced[rel] = seen

    def _sync_loop(self, every):
        while not self._stop.wait(every):
            try:
                self._sync()
            except Exception as e:  # a failed sync must not stop training; the next one retries
                log.warning("TensorBoard sync to %s failed: %s", self.remote, e)

    def close(self, final_metrics=None, step=None):
        if final_metrics and self.hparams:      # (the metrics' points at `step`: the last, not 0)
            self.writer.add_hparams({k: v for k, v in self.hparams.items()
                                     if isinstance(v, (int, float, str, bool))},
                                    {f"hparam/{k}": v for k, v in final_metrics.items()
                                     if isinstance(v, (int, float))}, run_name=".", global_step=step)
        self.writer.close()
        if self.remote:
            self._stop.set()
            self._thread.join()         # (a sync under way ends first: the last copy is the whole file)
            self._sync()
            shutil.rmtree(self.staging, ignore_errors=True)


class ReportLog:
    """Own code's TensorBoard: the numbers rank 0 passes to ctx.report(...) (and final(...)),
    as scalars report/<name> at their `step` (else the count of reports so far), in the
    run `<logdir>/<app_id>` the built-in runner writes. The writer opens at the first number.
    A generation's writer starts at the step of its first number: what earlier generations
    logged from that step on is dropped (the code resumed from there, from its own
    snapshot or from the start), so curves have no repeated steps after a restart. A
    metric never stops the code: a write or a sync that fails is a warning."""

    def __init__(self, logdir, run_name, sync_every=5.0, scratch=None):
        self.logdir, self.run_name, self.sync_every, self.scratch = logdir, run_name, sync_every, scratch
        self.tb, self.count, self.step = None, 0, 0

    def report(self, metrics, prefix="report/"):
        from .context import plain
        self.count += 1
        values = {}
        for k, v in metrics.items():
            v = plain(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values[k] = v
        step = values.pop("step", None)
        if step is not None and math.isfinite(step):
            self.step = int(step)
        elif prefix != "final/":
            self.step = self.count
        if not values:
            return
        try:
            if self.tb is None:
                self.tb = TBLogger(self.logdir, self.run_name, sync_every=self.sync_every, scalars_only=True,
                                   scratch=self.scratch,
                                   purge_step=self.step if prefix != "final/" else None)  # (a final purges nothing)
            self.tb.scalars(self.step, values, prefix=prefix)
        except Exception as e:  # noqa: BLE001 - a metric never stops training (e.g. a full disk)
            log.warning("TensorBoard: could not log %s at step %d: %s", sorted(values), self.step, e)

    def close(self):
        if self.tb is not None:
            try:
                self.tb.close()             # a remote logdir's last copy
            except Exception as e:  # noqa: BLE001 - the code is done; its result stands
                log.warning("TensorBoard: could not close %s: %s", self.logdir, e)
