"""TensorBoard on an application's event files: start it, wait until it answers, stop it.

Every run writes its events to ``<logdir>/<app_id>`` (training.tensorboard), so a
TensorBoard started on the logdir shows the runs of one experiment side by side.

    tb = TensorBoard(logdir)            # a local path, or any pyarrow URI (hdfs://, s3://...)
    tb.url                              # http://127.0.0.1:<port>/, answering
    tb.stop()                           # nothing of it keeps running

A non-local logdir is mirrored into a local cache directory by a background thread
every `sync_every` seconds while TensorBoard runs (event files only grow, so each
sync copies just the new bytes). `for_app(app_id)` finds an application's logdir
from its job.json. TensorBoard runs in a session of its own and is SIGKILLed if
the process that started it dies, so it never outlives its owner.
"""
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from training import fsutil

from .errors import YarnappError

log = logging.getLogger(__name__)

READY_TIMEOUT = 120.0        # seconds for TensorBoard to import, bind and answer
RELOAD_INTERVAL = 1.0        # seconds between TensorBoard's reloads: new runs and steps show within ~1 s
_URL_LINE = re.compile(r"TensorBoard \S+ at (http://\S+?):(\d+)/")


class Mirror:
    """Keeps `local_dir` a copy of the directory tree `path` on a pyarrow filesystem.

    Files are taken to be append-only, as TensorBoard's event files are: one that grew
    gets only its new bytes appended, one that shrank is copied whole.
    """

    def __init__(self, fs, path, local_dir):
        self.fs = fs
        self.path = path.rstrip("/")
        self.local_dir = local_dir
        os.makedirs(local_dir, exist_ok=True)

    def sync(self):
        """Copy what changed since the last call; returns the number of bytes copied."""
        import pyarrow.fs as pafs
        copied = 0
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True, allow_not_found=True))
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            rel = info.path[len(self.path):].lstrip("/")
            dest = os.path.join(self.local_dir, *rel.split("/"))
            have = os.path.getsize(dest) if os.path.exists(dest) else 0
            if info.size == have:
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            start = have if info.size > have else 0
            with self.fs.open_input_file(info.path) as src, open(dest, "r+b" if start else "wb") as out:
                src.seek(start)
                data = src.read(info.size - start)
                out.seek(start)
                out.write(data)
                out.truncate()
            copied += len(data)
        return copied


class TensorBoard:
    """A running TensorBoard on `logdir`; `url` answers once the constructor returns.

    host: the interface to bind (127.0.0.1; "0.0.0.0" serves every interface and
    `url` then names this machine by its fully qualified name). port: 0 picks a free
    one. sync_every: seconds between syncs of a non-local logdir. scratch: the directory
    its log and a non-local logdir's copy go under (a temporary directory of their own,
    removed by stop; default the system's temporary directory).
    Raises YarnappError if TensorBoard exits or does not answer within `timeout`.
    """
    SCRATCH_PREFIX = "yarnapp-tensorboard-"

    def __init__(self, logdir, port=0, host="127.0.0.1", sync_every=5.0, timeout=READY_TIMEOUT, scratch=None):
        self.logdir = logdir
        self._tmp = tempfile.mkdtemp(prefix=self.SCRATCH_PREFIX, dir=scratch)
        self._log_path = os.path.join(self._tmp, "tensorboard.log")
        self._stop_sync = threading.Event()
        self._sync_thread = None
        self.mirror = None
        self.proc = None
        try:
            self.served_dir = self._prepare(logdir)
            self._start(host, port, timeout)
            if self.mirror is not None:     # started after TensorBoard: no thread runs while it forks
                self._sync_thread = threading.Thread(target=self._sync_loop, args=(sync_every,), daemon=True,
                                                     name="tensorboard-sync")
                self._sync_thread.start()
        except BaseException:
            self.stop()
            raise

    def __repr__(self):
        return f"TensorBoard({self.logdir!r}, url={getattr(self, 'url', None)!r})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def _prepare(self, logdir):
        if fsutil.is_local(logdir):
            return os.path.abspath(fsutil.local_path(logdir))    # may not exist yet: runs appear once written
        from training.data.common import filesystem, info, one_line
        try:                # one line with what to do (libhdfs's failure is ~90 lines of dlopen)
            fs, path = filesystem(logdir)
            info(fs, path, logdir)      # reachable (the sync's listing of a tree takes a refusal for nothing there)
        except YarnappError as e:
            raise YarnappError(f"the logdir: {e}") from None
        self.mirror = Mirror(fs, path, os.path.join(self._tmp, "cache"))
        try:
            self.mirror.sync()
        except (OSError, ValueError) as e:
            raise YarnappError(f"cannot read the logdir {logdir!r}: {one_line(e)}") from None
        return self.mirror.local_dir

    def _sync_loop(self, every):
        while not self._stop_sync.wait(every):
            try:
                self.mirror.sync()
            except Exception as e:  # a failed sync must not end TensorBoard; the next one retries
                log.warning("syncing %s failed: %s", self.logdir, e)

    def _start(self, host, port, timeout):
        from launcher.procs import die_with_parent
        cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", self.served_dir, "--host", host,
               "--port", str(port), "--reload_interval", str(RELOAD_INTERVAL), "--load_fast", "false",
               "--window_title", f"yarnapp: {self.logdir}"]
        with open(self._log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        log.info("started TensorBoard (pid %d) on %s", self.proc.pid, self.served_dir)
        deadline = time.monotonic() + timeout
        local = "127.0.0.1" if host == "0.0.0.0" else host
        bound = None
        while True:
            if self.proc.poll() is not None:
                if port and "already in use" in self._read_log():
                    raise YarnappError(f"port {port} on {host} is in use by another process: give another port "
                                       f"(--port), or 0 for a free one")
                raise YarnappError(f"TensorBoard exited with status {self.proc.returncode} before answering: "
                                   f"{self._log_tail()}")
            if bound is None:
                m = _URL_LINE.search(self._read_log())
                if m:
                    bound = int(m.group(2))
            if bound is not None and self._answers(f"http://{local}:{bound}/"):
                break
            if time.monotonic() > deadline:
                raise YarnappError(f"TensorBoard did not answer within {timeout:.0f}s: {self._log_tail()}")
            time.sleep(0.1)
        self.port = bound
        self.url = f"http://{socket.getfqdn() if host == '0.0.0.0' else host}:{bound}/"
        log.info("TensorBoard answers at %s", self.url)

    @staticmethod
    def _answers(base):
        try:
            with urllib.request.urlopen(base + "data/runs", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _read_log(self):
        try:
            with open(self._log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _log_tail(self, lines=5):
        text = [line for line in self._read_log().splitlines() if line.strip()]
        return " | ".join(text[-lines:]) or "(no output)"

    @property
    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout=None):
        """Block until TensorBoard exits (or `timeout` seconds pass); return its exit status or None."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout=5.0):
        """Stop TensorBoard and the sync; idempotent. Nothing of it keeps running."""
        self._stop_sync.set()
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, None)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.proc is not None:
            try:                      # anything TensorBoard started in its session goes too
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._sync_thread is not None:
            self._sync_thread.join(timeout)
        shutil.rmtree(self._tmp, ignore_errors=True)


def logdir_of(app_id, backend=None):
    """(logdir, sync_every) of an application, from its job.json."""
    from .api import backend_for
    backend = backend or backend_for(app_id)
    if backend.name == "local":
        app_dir = backend.status(app_id)["app_dir"]
        with open(os.path.join(app_dir, "job.json")) as f:
            tb = json.load(f)["tensorboard"]
        return tb["logdir"] or os.path.join(app_dir, "tensorboard"), tb["sync_every"]
    return _yarn_logdir(app_id, backend)


def _yarn_logdir(app_id, backend):
    """On YARN the job.json is a file localized to every service: skein's spec names its copy in
    the staging directory; an unset logdir is <storage>/<app id>/tensorboard (YARNAPP_STORAGE)."""
    import skein

    from training import fsutil

    from .backends import yarn_cluster
    from .backends.yarn_cluster import python_uri
    try:
        spec = backend.client.connect(app_id, wait=False).get_specification()
        service = next(iter(spec.services.values()))
        fs, path = fsutil.resolve(python_uri(service.files["job.json"].source))
        with fs.open_input_stream(path) as f:
            tb = json.loads(f.read())["tensorboard"]
    except (skein.exceptions.SkeinError, KeyError, StopIteration, OSError, ValueError) as e:
        # an application that ended: its job went with its driver; an unset logdir was the default storage's
        from .backends.yarn import submitting_user
        storage = yarn_cluster.default_storage(submitting_user())
        guess = f"{storage.rstrip('/')}/{app_id}/tensorboard" if storage else None
        try:
            if guess and _is_dir(guess):
                return guess, _default_sync_s()
        except (OSError, ValueError):
            pass
        default = f" (an unset logdir was {guess})" if guess else ""
        raise YarnappError(f"cannot read the job of {app_id} from YARN ({e}); give its tensorboard.logdir "
                           f"instead: `yarnapp tensorboard URI`{default} (hdfs://... where libhdfs loads here, else "
                           f"webhdfs://NAMENODE:HTTP-PORT/...)") from None
    storage = service.env.get("YARNAPP_STORAGE")
    if not tb["logdir"] and not storage:
        raise YarnappError(f"{app_id} has no tensorboard.logdir: on YARN its event files stayed inside its "
                           f"containers; set tensorboard.logdir to shared storage (hdfs://...) in the job")
    return tb["logdir"] or f"{storage.rstrip('/')}/{app_id}/tensorboard", tb["sync_every"]


def _default_sync_s():
    """tensorboard.sync_every's default (conf/defaults.yaml): for a logdir given directly."""
    import conf
    from conf.units import parse_duration_s
    return parse_duration_s(conf.defaults()["tensorboard"]["sync_every"])


def _is_dir(uri):
    import pyarrow.fs as pafs

    from training import fsutil
    fs, path = fsutil.resolve(uri)
    return fs.get_file_info(path).type == pafs.FileType.Directory


APP_ID = re.compile(r"(app|application)_\d|latest$")     # the local engine's and YARN's ids


def for_app(app_or_logdir, port=0, backend=None):
    """TensorBoard for an application id (its logdir, every run of the experiment), or for a
    logdir given directly (a path or URI: anything with '/' in it, or a directory here that
    is not named like an application)."""
    if "/" in app_or_logdir or (os.path.isdir(app_or_logdir) and not APP_ID.match(app_or_logdir)):
        logdir, sync_every = app_or_logdir, _default_sync_s()
    else:
        logdir, sync_every = logdir_of(app_or_logdir, backend)
    return TensorBoard(logdir, port=port, sync_every=sync_every)


def show_in_notebook(tb, height=800):
    """Display TensorBoard inline (an IFrame) when running in a Jupyter kernel; else do nothing.

    Returns whether it displayed. The IFrame points at `notebook_url(tb)`: through the
    notebook server's own /proxy/ where jupyter-server-proxy is installed (a remote
    notebook: JupyterHub, Hopsworks), else at `tb.url`, which the browser must reach (a
    notebook served from this machine, or a forwarded port).
    """
    ipython = sys.modules.get("IPython")   # never imported here: outside IPython there is nothing to show
    shell = ipython.get_ipython() if ipython else None
    if shell is None or "IPKernelApp" not in getattr(shell, "config", {}):
        return False
    from IPython.display import IFrame, display
    display(IFrame(notebook_url(tb), width="100%", height=height))
    return True


def notebook_url(tb):
    """Where a notebook's browser finds TensorBoard: jupyter-server-proxy's `/proxy/<port>/`
    on the notebook server (the browser's own server, wherever it is; under JupyterHub
    after the user's prefix, $JUPYTERHUB_SERVICE_PREFIX) where that extension is installed
    in this environment, else `tb.url`."""
    import importlib.util
    import os
    if importlib.util.find_spec("jupyter_server_proxy") is not None:
        return f"{os.environ.get('JUPYTERHUB_SERVICE_PREFIX', '/').rstrip('/')}/proxy/{tb.port}/"
    return tb.url
