"""TensorBoard for applications: real jobs writing event files, real TensorBoard processes,
read over HTTP while the job runs; nothing may be left running afterwards."""
import importlib.util
import glob
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import psutil
import pytest

import yarnapp
from util import assert_nothing_left, until as _until, write_job
from yarnapp.backends.local.state import app_processes

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITER = os.path.join(ROOT, "tests", "jobs", "tb_writer.py")
TAG = "train/loss"


def _job(path, steps=None, **extra):
    return write_job(path, {
        "name": "tbw", "groups": [{"name": "w", "instances": 1, "vcores": 1, "memory": "512 MiB"}],
        "run": {"script": WRITER, "args": [str(steps)] if steps else []}, **extra})


def _get(url):
    """Parsed JSON at url, or None if nothing answers (or it has no such data yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _scalars(base, run, tag=TAG):
    q = urllib.parse.urlencode({"run": run, "tag": tag})
    return _get(f"{base.rstrip('/')}/data/plugin/scalars/scalars?{q}") or []


def _answers(base):
    return _get(base.rstrip("/") + "/data/runs") is not None


def _gone(pids):
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return not left


@pytest.mark.timeout(150)
def test_cli_serves_a_running_job_live_beside_other_runs_and_leaves_nothing(cli, yarnapp_home, tmp_path):
    logdir = tmp_path / "experiment"
    tb_conf = {"tensorboard": {"logdir": str(logdir)}}
    app = cli("submit", _job(tmp_path / "long.yaml", **tb_conf), check=0).stdout.strip()
    other = cli("submit", _job(tmp_path / "short.yaml", steps=5, **tb_conf), check=0).stdout.strip()

    proc = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "tensorboard", app], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready, "`yarnapp tensorboard` printed no URL within 90s"
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, proc.stderr.read() if proc.poll() is not None else "")
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert any("tensorboard.main" in " ".join(psutil.Process(p).cmdline()) for p in children), children

        # The loss of the running job, over HTTP, while it runs, and growing.
        _until(f"{TAG} of {app}", lambda: len(_scalars(url, app)) >= 3)
        n = len(_scalars(url, app))
        assert yarnapp.status(app)["state"] == "RUNNING"
        _until("new steps while the job runs", lambda: len(_scalars(url, app)) > n)
        points = _scalars(url, app)
        steps = [p[1] for p in points]
        assert steps == list(range(len(steps))), steps
        assert points[0][2] == pytest.approx(2.0) and points[-1][2] < points[0][2]
        assert yarnapp.status(app)["state"] == "RUNNING"
        # Runs of one experiment (same logdir) side by side.
        _until("both runs", lambda: set(_get(url + "data/runs") or []) == {app, other})
    finally:
        cli("kill", app)
        proc.send_signal(signal.SIGINT)             # Ctrl-C
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, proc.stderr.read()
    assert _until("TensorBoard's processes to end", lambda: _gone(children), timeout=10)
    assert not _answers(url)
    assert yarnapp.status(app)["state"] == "KILLED"
    assert_nothing_left(app)
    assert yarnapp.Run(other).wait(timeout=60)["state"] == "SUCCEEDED"
    assert_nothing_left(other)


NOTEBOOK = """import urllib.request, yarnapp
tb = yarnapp.Run({app!r}).tensorboard()
print("URL", tb.url)
print("RUNS", urllib.request.urlopen(tb.url + "data/runs").read().decode())
tb.stop()
"""


@pytest.mark.timeout(150)
def test_service_publishes_its_url_in_status_and_dies_with_the_application(cli, yarnapp_home, tmp_path):
    app = cli("submit", _job(tmp_path / "svc.yaml", tensorboard={"service": True}, am_attempts=2),
              check=0).stdout.strip()
    try:
        url = _until("the service's URL in the store", lambda: yarnapp.status(app)["tensorboard"])
        assert url.startswith("http://127.0.0.1:")
        assert f"tensorboard: {url}" in cli("status", app, check=0).stdout.splitlines()
        _until(f"{TAG} served by the service", lambda: len(_scalars(url, app)) >= 2)
        # a master that dies takes the service along; the next master's serves at the same address
        # (the page a user has open goes on answering: was another port, printed nowhere)
        os.kill(yarnapp.status(app)["am_pid"], signal.SIGKILL)
        _until("the second master's service", lambda: len(yarnapp.status(app)["am_attempts"]) == 2
               and yarnapp.status(app)["tensorboard"])
        assert yarnapp.status(app)["tensorboard"] == url
        assert "  application master attempt 2 (pid " in cli("status", app, check=0).stdout      # containers' attempts=1 again
        # (the store's URL is the first master's until the second's is up: its TensorBoard said so)
        _until("the second master's TensorBoard at the same address",
               lambda: len(re.findall(rf"launcher\.tensorboard_service: TensorBoard on \S+ at {re.escape(url)}/$",
                                      yarnapp.Run(app).logs("tensorboard")["tensorboard"], re.M)) == 2)
        _until(f"{TAG} served again", lambda: len(_scalars(url, app)) >= 2)
        assert yarnapp.status(app)["state"] == "RUNNING"
        scratch = os.path.join(yarnapp.status(app)["app_dir"], "containers", "tensorboard", "yarnapp-tensorboard-*")
        assert len(glob.glob(scratch)) == 1, glob.glob(scratch)    # the killed one's went (it stayed in /tmp for good)
        mine = [" ".join(p.cmdline()) for p in app_processes(app)]
        assert any("launcher.tensorboard_service" in c for c in mine), mine
        assert any("tensorboard.main" in c for c in mine), mine        # found by YARNAPP_APP_ID: swept at the end
        assert "TensorBoard on" in yarnapp.Run(app).logs("tensorboard")["tensorboard"]
        # TensorBoard itself killed: started again, at the same address (it vanished from status)
        [board] = [p for p in app_processes(app) if "tensorboard.main" in " ".join(p.cmdline())]
        board.kill()
        _until("TensorBoard started again", lambda: any("tensorboard.main" in " ".join(p.cmdline())
                                                        for p in app_processes(app) if p.pid != board.pid))
        _until(f"{TAG} served after the restart", lambda: len(_scalars(url, app)) >= 2)
        assert yarnapp.status(app)["tensorboard"] == url
        assert "TensorBoard exited with status -9; starting it again (1 of 3)" in \
            yarnapp.Run(app).logs("tensorboard")["tensorboard"]
        # the service itself killed: its URL goes from status (it was shown, answering nothing)
        [service] = [p for p in app_processes(app) if "launcher.tensorboard_service" in " ".join(p.cmdline())]
        service.kill()
        _until("the URL gone with the service", lambda: yarnapp.status(app)["tensorboard"] is None, timeout=30)
    finally:
        cli("kill", app)
    assert_nothing_left(app)
    assert not _answers(url)
    assert yarnapp.status(app)["tensorboard"] is None
    assert not glob.glob(scratch), glob.glob(scratch)

    # After the end, Run.tensorboard() still serves the run, and in a notebook shows it inline.
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK.format(app=app))])
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": ROOT}})
    client.execute()
    outputs = nb.cells[0].outputs
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    nb_url = printed.split("URL ", 1)[1].split()[0]
    assert app in json.loads(printed.split("RUNS ", 1)[1].splitlines()[0])
    html = [o["data"]["text/html"] for o in outputs if o.output_type == "display_data" and "text/html" in o.data]
    assert html and "<iframe" in html[0] and nb_url in html[0], outputs
    assert not _answers(nb_url)


def test_mirror_copies_only_what_grew(tmp_path):
    """A non-local logdir is mirrored; a local directory seen through pyarrow stands in for hdfs://."""
    import pyarrow.fs as pafs

    from training.tensorboard import TBLogger
    from yarnapp.tensorboard import Mirror
    remote = pafs.SubTreeFileSystem(str(tmp_path / "remote"), pafs.LocalFileSystem())
    tb = TBLogger(str(tmp_path / "remote" / "logs"), "app_1")
    tb.scalars(0, {"loss": 1.0})
    mirror = Mirror(remote, "logs", str(tmp_path / "cache"))

    def same():
        src = tmp_path / "remote" / "logs" / "app_1"
        dst = tmp_path / "cache" / "app_1"
        return sorted(os.listdir(src)) == sorted(os.listdir(dst)) and all(
            (src / f).read_bytes() == (dst / f).read_bytes() for f in os.listdir(src))
    assert mirror.sync() > 0 and same()
    before = sum(f.stat().st_size for f in (tmp_path / "cache" / "app_1").iterdir())
    tb.scalars(1, {"loss": 0.5})
    grew = mirror.sync()
    assert grew > 0 and same()
    assert grew < before                       # only the appended bytes were copied
    assert mirror.sync() == 0                  # nothing changed, nothing copied
    tb.close()


def test_a_remote_logdir_is_synced_in_event_files_of_bounded_size_each_copied_once_done(tmp_path, monkeypatch):
    """A long-run audit: every sync to a remote logdir copied the whole event file again
    (21.7 MB copied for a 3 MB file; ~700 MB every 5 s after a day). Event files now end at
    ROTATE_BYTES and one done with is not copied again. hdfs:// is reached through
    fsutil.resolve, the adapter: here a local directory stands in for it."""
    import pyarrow.fs as pafs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training import fsutil, tensorboard
    remote = tmp_path / "remote"
    monkeypatch.setattr(fsutil, "resolve", lambda uri: (pafs.LocalFileSystem(), str(remote) + uri[len("hdfs://nn"):]))
    monkeypatch.setattr(tensorboard, "ROTATE_BYTES", 2048)
    tb = tensorboard.TBLogger("hdfs://nn/tb", "app_1", sync_every=3600, scalars_only=True, scratch=str(tmp_path))
    run = remote / "tb" / "app_1"
    copied = {}
    for step in range(1, 401):
        tb.scalars(step, {f"m{i}": step / (i + 1) for i in range(4)})
        time.sleep(0.01)                    # (a file a second at most)
        if step % 40 == 0:
            tb._sync()
            for f in os.listdir(run):
                copied.setdefault(f, set()).add(os.stat(run / f).st_mtime_ns)
    tb.close()
    files = sorted(os.listdir(run))
    assert len(files) >= 3, files
    # each file was copied while it grew and once more at most (its last bytes, as it was
    # closed), not at every one of the 10 syncs
    assert max(len(times) for times in copied.values()) <= 4, copied
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("m0")] == list(range(1, 401))


def test_a_logdir_tensorboard_cannot_open_or_reach_is_one_line_and_starts_nothing(cli):
    """hdfs:// without libhdfs here printed pyarrow's ~90 lines of dlopen failures; an
    unreachable WebHDFS started a TensorBoard on nothing (a listing takes a refused
    connection for an empty tree)."""
    for logdir, says in (("hdfs://localhost:9000/tb", " hdfs://localhost:9000/tb: "),     # no libhdfs, or no namenode
                         ("webhdfs://localhost:1/tb", "cannot reach webhdfs://localhost:1/tb"),
                         ("nosuch://x/tb", "check the scheme")):
        proc = cli("tensorboard", logdir, check=1, timeout=60)
        assert proc.stderr.startswith("Error: the logdir: ") and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_relative_logdir_is_served_and_a_file_or_a_taken_port_is_one_line(cli, tmp_path, monkeypatch):
    """`yarnapp tensorboard tblog` (a directory here) was looked up as an application id; a
    file was served as a logdir "that does not exist (yet)"; a taken --port ended in
    TensorBoard's own three messages."""
    from yarnapp import tensorboard
    (tmp_path / "tblog").mkdir()
    monkeypatch.chdir(tmp_path)
    with tensorboard.for_app("tblog") as tb:
        assert tb.served_dir == str(tmp_path / "tblog") and _answers(tb.url)
        with pytest.raises(yarnapp.YarnappError, match=rf"^port {tb.port} on 127.0.0.1 is in use by another process: "
                                                       r"give another port \(--port\), or 0 for a free one$"):
            tensorboard.TensorBoard(str(tmp_path / "tblog"), port=tb.port)
    proc = cli("tensorboard", "/etc/passwd", check=1)
    assert proc.stderr == "Error: /etc/passwd is a file; give a logdir (a directory or URI) or an application id\n"


def test_a_notebooks_tensorboard_url_goes_through_jupyter_server_proxy_where_it_is_installed(tmp_path, monkeypatch):
    """The URL only (the proxy itself is not started here). A remote notebook (JupyterHub, Hopsworks) could not reach 127.0.0.1:<port>: with
    jupyter-server-proxy in the environment the inline view goes through the notebook
    server's /proxy/<port>/, under the hub's user prefix."""
    import types

    from yarnapp.tensorboard import notebook_url
    tb = types.SimpleNamespace(port=43373, url="http://127.0.0.1:43373/")
    monkeypatch.delenv("JUPYTERHUB_SERVICE_PREFIX", raising=False)
    if importlib.util.find_spec("jupyter_server_proxy") is None:
        assert notebook_url(tb) == tb.url
    (tmp_path / "jupyter_server_proxy").mkdir()
    (tmp_path / "jupyter_server_proxy" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert notebook_url(tb) == "/proxy/43373/"
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/alice/")
    assert notebook_url(tb) == "/user/alice/proxy/43373/"


def test_cli_tensorboard_stopped_by_sigterm_ends_as_a_shell_gives_and_leaves_nothing(tmp_path):
    """`timeout 1h yarnapp tensorboard DIR`: Ctrl-C ends it with 0 (how it is stopped), SIGTERM
    with 143, as every other command's (it was 0: a CI step could not tell it was killed)."""
    logdir = tmp_path / "runs"
    logdir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "yarnapp.cli", "tensorboard", str(logdir)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready, "`yarnapp tensorboard` printed no URL within 90s"
        url = proc.stdout.readline().strip()
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.terminate()
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 143, proc.stderr.read()
    assert _until("TensorBoard's processes to end", lambda: _gone(children), timeout=10)
    assert not _answers(url)
