"""The local engine's resource manager for one application: it starts the application
master and, when the master dies, does what YARN's ResourceManager does (AM attempts).

    submit ──► supervisor ──► AM attempt 1 ──► containers ...
                   │  the AM ended the application (SUCCEEDED | FAILED | KILLED): done
                   │  the AM died without ending it (a signal, a crash), or stayed stopped
                   │  (SIGSTOP, a frozen process) longer than launcher.heartbeat_timeout and
                   │  was killed for it, as YARN expires an AM that stops heartbeating:
                   │     its containers died with it (they die with their parent); clean up
                   │     what nothing else will (processes that escaped, cgroups, emulated
                   │     network), then
                   ├─► AM attempt n+1 (while n < job.am_attempts): it aborts the world's
                   │     generation as not the job's fault and starts every container
                   │     again; training resumes from the newest complete checkpoint
                   └─► no attempts left: FAILED, naming the master; nothing runs

`yarnapp kill` sends SIGTERM here (the pid is in supervisor.json); it is passed on to
the AM, which stops the containers and ends the application KILLED, and no new attempt
is started. The supervisor carries no YARNAPP_APP_ID of its own, so the AM's final sweep
of the application's processes leaves it alone; it exits right after the AM.

    python -m yarnapp.backends.local.supervisor APP_DIR
"""
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from launcher import exitcodes
from launcher.failure import Failure, Kind
from launcher.procs import stopped as process_stopped

from ..base import TERMINAL
from . import cgroups, netem
from .state import app_processes, kill_words, read_json, replace_whole, write_json, write_state

log = logging.getLogger("yarnapp.supervisor")

RECORD = "supervisor.json"


def record_path(app_dir):
    return os.path.join(app_dir, RECORD)


def write_record(app_dir, record):
    """The supervisor's record, replaced whole (a reader never sees it half-written), with
    its process's start time (`alive`: a pid taken since by another process is not it)."""
    try:
        record = dict(record, started=psutil.Process(record["pid"]).create_time())
    except psutil.Error:
        pass
    replace_whole(record_path(app_dir), lambda f: json.dump(record, f), tmp=record_path(app_dir) + f".{os.getpid()}.tmp")


def alive(app_dir):
    """Whether the application's supervisor runs (it outlives a dead AM while it restarts one):
    its pid, started when its record says (a pid taken since by another process, days after
    it ended, is not it)."""
    record = read_json(record_path(app_dir)) or {}
    pid = record.get("pid")
    if not pid or not psutil.pid_exists(pid):
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return record.get("started") is None or abs(p.create_time() - record["started"]) < 0.01
    except psutil.Error:
        return False


def clean_up(app_id, keep=()):
    """What a dead AM leaves behind: processes of the application that outlived it, its
    cgroups, its emulated network. Returns the pids it killed."""
    killed = []
    for p in app_processes(app_id):
        if p.pid in keep:
            continue
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.Error:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [p for p in app_processes(app_id) if p.pid not in keep]:
        time.sleep(0.05)
    deadline = time.monotonic() + 10         # a SIGKILLed process takes a moment to leave its cgroup
    while cgroups.Limits.remove_app(app_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    if netem.unavailable_reason() is None:
        netem.sweep(app_id)
    return killed


class Supervisor:
    def __init__(self, app_dir):
        import conf
        self.dir = app_dir
        with open(os.path.join(app_dir, "job.json")) as f:
            self.job = conf.load_job(json.load(f), stored=True)
        self.app_id = read_json(os.path.join(app_dir, "app.json"))["app_id"]
        self.am = None
        self.stopping = False
        self.stopped_by = None      # the KILLED diagnostics (state.kill_words)
        self.attempts = []

    def save(self):
        write_record(self.dir, {"pid": os.getpid(), "am_attempts": self.job.am_attempts, "attempts": self.attempts})

    def on_signal(self, signum, frame):
        if not self.stopping:
            self.stopped_by = kill_words(self.dir, signum, f"its supervisor (pid {os.getpid()})")
            if self.stopped_by != "killed by the user":      # the master says it too
                write_json(os.path.join(self.dir, "stop_reason"), {"diagnostics": self.stopped_by})
        self.stopping = True
        if self.am and self.am.poll() is None:
            self.am.send_signal(signal.SIGTERM)
            if process_stopped(self.am.pid):    # it cannot stop its containers
                self.am.kill()

    def wait_am(self):
        """(the master's exit status, how it ended in words). A master stopped (SIGSTOP, a
        frozen process) for longer than launcher.heartbeat_timeout is killed, and its attempt
        ends as a master's death does: before, training ended, the final model was written,
        and the application stayed RUNNING with its containers unreaped under the stopped
        master."""
        limit = self.job.launcher.heartbeat_timeout
        ended = threading.Event()       # (Popen.wait(timeout) polls every 50 ms; a thread waits instead)
        threading.Thread(target=lambda: (self.am.wait(), ended.set()), daemon=True).start()
        since, hung = None, None
        while not ended.wait(1.0):
            if not process_stopped(self.am.pid):
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since > limit and hung is None:
                hung = (f"was stopped for {time.monotonic() - since:.0f}s (limit {limit:g}s: "
                        f"launcher.heartbeat_timeout), so it was killed")
                log.error("the application master (pid %d) %s", self.am.pid, hung)
                self.am.kill()
        return self.am.returncode, hung or exitcodes.describe(self.am.returncode)[0]

    def start_am(self, attempt):
        env = dict(os.environ, YARNAPP_APP_ID=self.app_id, PYTHONUNBUFFERED="1")
        with open(os.path.join(self.dir, "am.log"), "ab") as out:
            self.am = subprocess.Popen([sys.executable, "-m", "yarnapp.backends.local.am", self.dir,
                                        "--attempt", str(attempt)], env=env, cwd=self.dir,
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.attempts.append({"attempt": attempt, "pid": self.am.pid, "started": time.time()})
        self.save()
        log.info("application master attempt %d started (pid %d)", attempt, self.am.pid)

    def run(self):
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        attempt = 0
        while True:
            attempt += 1
            self.start_am(attempt)
            if self.stopping:           # stopped while the master was starting: on_signal found no one
                self.am.send_signal(signal.SIGTERM)
            rc, how = self.wait_am()
            self.attempts[-1].update(exit_code=rc, ended=time.time(), how=how)     # (the next master says it)
            self.save()
            st = read_json(os.path.join(self.dir, "state.json")) or {}
            if st.get("state") in TERMINAL:
                return 0
            what = f"the application master (attempt {attempt}, pid {self.am.pid}) {how}"
            killed = clean_up(self.app_id, keep={os.getpid()})
            (log.info if self.stopping else log.error)(     # (a kill mid-start is no error of its own)
                "%s without ending the application; cleaned up (%d processes killed)", what, len(killed))
            if self.stopping or attempt >= self.job.am_attempts:
                self.finish(st, "KILLED" if self.stopping else "FAILED",
                            self.stopped_by if self.stopping else
                            f"{what}; no application master attempts left (am_attempts: {self.job.am_attempts})")
                return 0 if self.stopping else 1
            log.warning("%s; starting attempt %d of %d", what, attempt + 1, self.job.am_attempts)

    def finish(self, st, state, diagnostics):
        end(self.dir, st, state, diagnostics, app_id=self.app_id, name=self.job.name)


def end(app_dir, st, state, diagnostics, log=None, **fields):
    """Write the final state of an application whose master did not write one (it died, or
    was killed before it could): `st` is what state.json held, `fields` what it lacks; `log`
    the log a failure points at (the master's). Returns the state written."""
    st = dict(st or {}, **fields, state=state, diagnostics=diagnostics, finished=time.time())
    st.setdefault("containers", [])
    for c in st["containers"]:
        if c.get("state") == "RUNNING":
            c["state"] = state
    if state == "FAILED":
        st["failure"] = Failure(reason=diagnostics, kind=Kind.CONTAINER.value, container="master",
                                log=log or os.path.join(app_dir, "am.log")).stamped().as_dict()
    write_state(app_dir, st)
    return st


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s: %(message)s")
    return Supervisor(argv[0]).run()


if __name__ == "__main__":
    sys.exit(main())
