"""The on-disk layout of a local application, shared by the AM and the client.

    $YARNAPP_HOME/apps/<app_id>/
        app.json        id, secret, submit time (written once by the client, atomic rename)
        job.json        the resolved job spec
        state.json      written by the AM on every change (atomic rename)
        kill_request    written by `yarnapp kill` before it signals (kill_words)
        stop_reason     written by a supervisor signalled from elsewhere (kill_words)
        am.log          the AM's log
        store/          the coordination store (launcher.store.FileStore)
        containers/<id>/container.log, work/
"""
import json
import os
import signal
import time

import psutil


def home():
    return os.environ.get("YARNAPP_HOME") or os.path.join(os.path.expanduser("~"), ".yarnapp")


def apps_dir():
    return os.path.join(home(), "apps")


def no_application(app_id):
    """The line for an application id not in this home (another user's, or another
    YARNAPP_HOME's, is not found here)."""
    return (f"no application {app_id!r} on the local engine in {home()} (YARNAPP_HOME); `yarnapp list` shows "
            f"its applications")


def write_json(path, obj):
    """Write whole or not at all (a temporary file renamed): a reader never sees half of it.
    Owner-only, whatever the umask (an application's records: app.json holds its secret)."""
    replace_whole(path, lambda f: json.dump(obj, f, indent=1))


def replace_whole(path, write, tmp=None):
    """`path` replaced by what write(f) writes to a temporary file beside it, renamed over
    it; on any error (a disk full) the temporary file is removed, and `path` is as it was."""
    tmp = tmp or os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with private(tmp) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def private(path):
    """`path` opened for writing text, created owner-only (0600) whatever the umask."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")


def umask():
    """This process's umask, read without setting it: os.umask sets it for every thread
    (two submits from two threads of a notebook left it 077)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)       # (no /proc: set and restored at once)
    os.umask(old)
    return old


def write_state(app_dir, state):
    write_json(os.path.join(app_dir, "state.json"), state)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def request_kill(app_dir):
    """`yarnapp kill` (or an interrupted `submit --wait`) asks: written before the signal."""
    write_json(os.path.join(app_dir, "kill_request"), {"time": time.time(), "pid": os.getpid()})


def kill_words(app_dir, signum, who):
    """The diagnostics of an application stopped by signal `signum` sent to `who` (its
    supervisor, its master): "killed by the user" where `yarnapp kill` asked; else where
    a supervisor said why (stop_reason), that; else the signal from elsewhere (a host
    shutting down, or someone's kill: "killed by the user" said so before)."""
    if os.path.exists(os.path.join(app_dir, "kill_request")):
        return "killed by the user"
    said = read_json(os.path.join(app_dir, "stop_reason"))
    if said:
        return said["diagnostics"]
    name = signal.Signals(signum).name if signum else "a signal"
    return f"killed: {who} was sent {name} from outside yarnapp (not by `yarnapp kill`)"


def app_processes(app_id, exclude=None):
    """Every live process that belongs to the application (found by its environment), of
    this user's: another user's process that set YARNAPP_APP_ID to an id of ours kept root's
    `clean` from removing the application, and root's `kill` killed it (a security audit)."""
    marker = f"YARNAPP_APP_ID={app_id}".encode()
    out, me = [], os.getuid()
    for p in psutil.process_iter(["pid", "uids"]):
        if p.pid == exclude or p.info["uids"] is None or p.info["uids"].real != me:
            continue
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    if p.status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def wait_ended(pid, timeout, interval=0.05):
    """Wait up to `timeout` seconds for process `pid` to end: gone, or a zombie its parent
    has not reaped yet. Returns whether it did."""
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def tree_bytes(path):
    """The disk the files and directories under `path` take (links not followed; a file
    gone meanwhile: 0): their blocks, not their sizes (2,000 small applications were said
    to free 17 MiB, and freed 320 MB)."""
    total = 0
    for root, dirs, files in os.walk(path):
        for f in files + dirs:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total
