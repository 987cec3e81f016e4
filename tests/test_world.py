"""The world's handshake against real foreign processes: a process that connects to a
forming world with a wrong token, or connects and says nothing, is refused within
seconds and never becomes a member; the job goes on and succeeds."""
import os
import subprocess
import sys

import pytest

import yarnapp
from util import assert_nothing_left

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "jobs")


@pytest.mark.parametrize("mode, why", [("wrong-token", "wrong token (asked to join as rank 1)"),
                                       ("silent", "said nothing within 5s")])
def test_a_foreign_joiner_is_refused_and_the_job_succeeds(mode, why, yarnapp_home):
    # Ranks 1 and 2 join this late, keeping the world open for the foreign process (started
    # with the job, it knocks within a second of rank 0 publishing its port): a wrong token is
    # refused at once; a silent one after 5 s, while rank 1's Connect waits behind it (Accept
    # takes one joiner at a time).
    delay = {"wrong-token": "4", "silent": "5"}[mode]
    job = {"name": "knock", "max_restarts": 0,
           "groups": [{"name": "big", "instances": 1, "vcores": 1, "memory": "1 GiB"},
                      {"name": "small", "instances": 2, "vcores": 0.5, "memory": "1 GiB",
                       "env": {"JOIN_DELAY": delay}}],
           "run": {"function": "slow_join:main", "files": [os.path.join(JOBS, "slow_join.py")]}}
    run = yarnapp.submit(job)
    store = os.path.join(run.status()["app_dir"], "store")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    foreign = subprocess.Popen([sys.executable, os.path.join(JOBS, "foreign_joiner.py"), store, mode],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        st = run.wait(timeout=180)
        assert st["state"] == "SUCCEEDED", run.logs()
        assert st["final"] == {"world": 3, "total": 6.0}          # the three ranks, and no one else
        log = run.logs("big_0")["big_0"]
        assert f"refused a process that connected to join generation 0: {why}" in log, log
        if mode == "wrong-token":
            out, _ = foreign.communicate(timeout=30)
            assert foreign.returncode == 0 and "refused" in out, out
    finally:
        foreign.kill()
        foreign.communicate()
    assert_nothing_left(run.app_id)


WORLD_STARTER = """
import sys
from launcher.world import run_local
from training.probes import stop_cleanly_on_sigterm
stop_cleanly_on_sigterm()
print("started", flush=True)
run_local([sys.executable, "-c", "import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close(); "
           "time.sleep(600)", sys.argv[1]], 2, timeout=600)
"""


@pytest.mark.parametrize("handled", [True, False], ids=["sigterm-handled", "sigkill"])
def test_a_script_killed_stops_the_world_it_started(tmp_path, handled):
    """Benchmarks and `yarnapp plan` start worlds with launcher.world.run_local. `kill` or
    `timeout` (SIGTERM) stops them through training.probes.stop_cleanly_on_sigterm as
    Ctrl-C does, so run_local kills the ranks instead of leaving them to sleep; a starter
    killed outright (SIGKILL, or SIGTERM without that handler: a benchmark under `timeout`
    left the planner's probes computing for minutes) takes its ranks with it."""
    import signal
    import time
    code = WORLD_STARTER if handled else WORLD_STARTER.replace("stop_cleanly_on_sigterm()\n", "")
    script = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert script.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2
    script.send_signal(signal.SIGTERM if handled else signal.SIGKILL)
    assert script.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if os.path.exists(f"/proc/{p}")]
    for p in left:
        os.kill(p, 9)
    assert not left, f"ranks {left} still run after their starter was stopped"


INTERRUPTED_STARTER = """
import os, signal, subprocess, sys, threading
from launcher.world import spawn_local
from training.probes import stop_cleanly_on_sigterm
stop_cleanly_on_sigterm()
started, popen = [], subprocess.Popen
def counted(*a, **kw):
    p = popen(*a, **kw)
    started.append(p.pid)
    if len(started) == 3:                       # SIGTERM while the rest are still to start
        threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()
    return p
subprocess.Popen = counted
try:
    spawn_local(["sleep", sys.argv[1]], 60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
except KeyboardInterrupt:
    print(len(started), *started)
    sys.exit(130)
"""


def test_sigterm_while_a_world_starts_stops_the_ranks_already_started():
    """An interrupt that arrives while spawn_local is still starting ranks (`yarnapp plan`
    stopped as its link probe starts) is handled once they have all started, and stops every
    one: before, the ranks already started were lost with the half-built list and waited
    for the rest of their world."""
    token = f"599.{os.getpid()}"                # `sleep 599.PID`: these ranks, by their command line
    script = subprocess.run([sys.executable, "-c", INTERRUPTED_STARTER, token], capture_output=True, text=True,
                            timeout=120)
    assert script.returncode == 130, script.stderr
    count, *pids = map(int, script.stdout.split())
    assert count >= 3 and len(pids) == count
    left = _sleepers_left(token)
    assert not left, f"{len(left)} of the {count} ranks started still run"


def _sleepers_left(token, wait_s=10.0):
    """The `sleep TOKEN` ranks still running after up to wait_s seconds (killed, so that a
    failing test leaves none)."""
    import time
    deadline = time.monotonic() + wait_s
    while (left := subprocess.run(["pgrep", "-f", f"sleep {token}$"], capture_output=True, text=True).stdout.split()) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in left:
        os.kill(int(p), 9)
    return left


def test_an_interrupt_while_run_local_starts_its_pipe_readers_stops_the_ranks_and_is_raised(monkeypatch):
    """`kill` just as `yarnapp plan`'s ping-pong probe started (seen once in CI): the
    interrupt came while run_local started the threads that read its ranks' pipes, and its
    cleanup joined one not yet started: a RuntimeError's traceback and status 1, instead of
    "interrupted" and 143. Here the interrupt comes in the second thread's start, as the
    signal handler raises it there."""
    import threading

    from launcher.world import run_local
    real, started = threading.Thread.start, []

    def start(self):
        started.append(self)
        if len(started) == 2:
            raise KeyboardInterrupt
        real(self)
    token = f"598.{os.getpid()}"
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        run_local(["sleep", token], 2, timeout=60)
    monkeypatch.undo()
    left = _sleepers_left(token)
    assert not left, f"{len(left)} ranks still run"


def test_interrupts_deferred_hands_a_signal_to_its_handler_on_leaving_and_keeps_ignored_ones():
    import signal

    from launcher import interrupts
    seen, before = [], {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts.deferred():
            signal.raise_signal(signal.SIGTERM)
            assert seen == []                           # held back inside
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN      # children still inherit it ignored
        assert seen == [signal.SIGTERM]                 # handled once, on leaving
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for s, h in before.items():
            signal.signal(s, h)


LATE_JOINER = """
import os, time
from launcher import world
rank = int(os.environ[world.LOCAL_WORLD_ENV].split(":")[1])
if rank == 2:
    time.sleep(6)               # still importing, on a busy host
t0, c0 = time.monotonic(), time.process_time()
comm, rank, size = world.join_local()
print(round(time.process_time() - c0, 2), round(time.monotonic() - t0, 2), comm.allreduce(rank))
"""


def test_members_wait_for_a_late_joiner_idle():
    """MPI's blocking Accept spins a core until a joiner comes: the members of a world whose
    last rank was 6 s late burnt 6 CPU-seconds each (on one host, the CPU its importing
    ranks needed). They wait in the store until the joiner says it connects."""
    from launcher.world import run_local
    out = run_local([sys.executable, "-c", LATE_JOINER], 3, timeout=120)
    assert [rc for rc, _, _ in out] == [0, 0, 0], out
    cpu, wall, total = zip(*(map(float, o.split()) for _, o, _ in out))
    assert total == (3.0, 3.0, 3.0) and min(wall[:2]) > 4.0, out
    assert max(cpu[:2]) < 1.5, out           # spinning, each used 6
