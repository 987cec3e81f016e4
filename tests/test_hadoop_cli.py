"""`yarnapp hadoop`'s refusals: one line each, nothing started. (Starting and stopping the
real daemons is what tests/test_yarn_real.py's session cluster does.)"""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from yarnapp import hadoop

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "yarnapp.cli", "hadoop", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.alone      # a free port base, then binds in it: not while a cluster starts
def test_a_taken_port_is_one_line_naming_it(tmp_path):
    base = hadoop.free_port_base()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", base + 88))
        s.listen(1)
        out = cli("start", "--dir", tmp_path / "h", "--port-base", base, "-q")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"Error: port {base + 88} (ResourceManager web (and its proxy)) on 127.0.0.1 is taken by another "
        f"process; stop it or choose other ports with --port-base"]
    assert not os.path.exists(tmp_path / "h" / "run")            # nothing was started


@pytest.mark.alone      # a free port base, then binds in it: not while a cluster starts
def test_stop_waits_for_a_process_whose_main_thread_ended_while_others_still_hold_its_port():
    # A JVM ends its main thread first: /proc/PID/stat says Z while its other threads still
    # run and hold the daemon's listening socket. stop() must wait for them, or the next
    # start finds its own port taken (`yarnapp hadoop stop && yarnapp hadoop start`).
    base = hadoop.free_port_base()
    code = ("import signal, socket, threading, time, ctypes\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)\n"      # shut down slowly, as a JVM does
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('127.0.0.1', {base + 20})); s.listen(1)\n"
            "threading.Thread(target=time.sleep, args=(2,)).start()\n"
            "print('ready', flush=True)\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 5
        while hadoop._state(proc.pid) == "running" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hadoop._state(proc.pid) == "exiting" and not hadoop.port_free(base + 20)
        t0 = time.monotonic()
        hadoop._terminate(proc.pid, None, 10.0)          # SIGTERM; the last thread ends ~2 s after start
        assert time.monotonic() - t0 < 5
        assert hadoop._state(proc.pid) == "gone" and hadoop.port_free(base + 20)
    finally:
        proc.kill()
        proc.wait()


def test_impossible_ports_and_resources_are_one_line_and_start_nothing(tmp_path):
    """A port base of -5 started the daemons on ports 15-83 (and was saved for every later
    start), 70000 ended in bind()'s OverflowError, --memory abc in a traceback, --vcores 0
    was taken."""
    for args, line in [(["--port-base", -5], "--port-base -5: its ports run from base+20 to base+88; give a base "
                                             "from 1024 to 65447"),
                       (["--port-base", 70000], "--port-base 70000: its ports run from base+20"),
                       (["--memory", "abc"], "--memory: cannot parse 'abc' as memory; write e.g. 512 MiB"),
                       (["--vcores", 0], "--vcores 0: the NodeManager needs more than 0")]:
        out = cli("start", "--dir", tmp_path / "h", "-q", *args)
        assert out.returncode == 2 and out.stderr.startswith(f"Error: {line}") and out.stderr.count("\n") == 1, \
            (args, out.stderr)
        assert not os.path.exists(tmp_path / "h"), args


def test_no_maven_is_one_line(tmp_path):
    java = os.path.dirname(os.path.realpath(shutil.which("java") or "/usr/bin/java"))
    out = cli("start", "--dir", tmp_path / "h", "-q",
              env={"YARNAPP_HOME": str(tmp_path / "home"), "PATH": f"{os.path.dirname(sys.executable)}:{java}"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"Error: no Maven (`mvn`) on PATH: it fetches Hadoop {hadoop.version()}'s jars from Maven Central once; "
        f"install Maven (e.g. apt-get install maven)"]


def test_status_and_env_of_a_stopped_cluster(tmp_path):
    st = cli("status", "--dir", tmp_path / "h")       # (it gave a version and ports of a cluster never made)
    assert st.returncode == 3 and st.stdout == f"no local Hadoop in {tmp_path / 'h'} yet; `yarnapp hadoop start " \
                                                f"--dir {tmp_path / 'h'}` makes and starts it\n", st.stdout
    out = cli("env", "--dir", tmp_path / "h", "--port-base", 29000)
    env = out.stdout.splitlines()
    assert f"export HADOOP_CONF_DIR={tmp_path / 'h' / 'etc' / 'hadoop'}" in env
    # never started: said on stderr (a shell profile that evals the exports still can)
    assert out.returncode == 0 and out.stderr.strip() == (
        f"note: no local Hadoop in {tmp_path / 'h'} yet; `yarnapp hadoop start --dir {tmp_path / 'h'}` "
        f"makes and starts it")
    assert any(line.startswith(f"export PATH={tmp_path / 'h' / 'bin'}:") for line in env)
    assert cli("stop", "--dir", tmp_path / "h").returncode == 0
