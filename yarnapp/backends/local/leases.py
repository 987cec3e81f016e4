"""The local engine's ledger of the machine's GPUs and memory, as one NodeManager keeps its
node's: no two containers share a GPU, and the applications running together never hold
more memory than the machine has.

Every application's master leases, before it starts its containers, the whole GPUs and the
memory (the sum of its containers' `memory`) they ask for, from one ledger of the machine
($YARNAPP_LEDGER, else <tmp>/yarnapp-leases/leases.json, under an flock: every user's
engine, whatever its YARNAPP_HOME, sees the same machine). One that does not fit beside
the others waits (ACCEPTED, saying for whom) until they end, in line: first come, first
served for what it waits for (a later application never takes the GPUs, or the memory,
an earlier one waits for, even where it would fit: a stream of small jobs would keep a
large one waiting for ever; one that needs neither passes it). A lease of a master that is
gone is free again. A job asking for more than the machine has in all is refused at
submit (yarnapp.backends.local.engine.check_resources). A CPU quota is a cap, not a
reservation: vcores are shared, as YARN's default scheduler shares them (it counts
memory only). (Every local user may write the ledger: it keeps engines apart, it does not
police users; a cluster's resources are YARN's.)
"""
import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import tempfile
import time

import psutil

log = logging.getLogger(__name__)


def _open_own(path):
    """The ledger's file at `path` for reading and writing, made if missing (readable and
    writable by every user, the umask left alone: only its creator may chmod it). Never
    through a link: a symlink or a hard link planted in the shared folder (any user may make
    it first) made the engine rewrite, and chmod 0666, a file of whoever ran it, root's too.
    OSError (EPERM) for one that is not a plain file of one name."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.EPERM, "a symbolic link, not a file of its own (remove it)") from None
        raise
    try:
        st = os.fstat(fd)
        # another name of a file not everyone may write (a user's own, root's) is not the ledger;
        # one of the ledger itself (0666: anyone may link it) is, or every engine was refused
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 and not st.st_mode & stat.S_IWOTH:
            raise OSError(1, f"not a file of its own (a link: {st.st_nlink} names; remove it)")
        if st.st_nlink == 1 and stat.S_IMODE(st.st_mode) != 0o666:
            with contextlib.suppress(OSError):      # (its creator's, or anyone's where squashed to nobody)
                os.fchmod(fd, 0o666)
        return os.fdopen(fd, "r+")
    except BaseException:
        os.close(fd)
        raise


class Leases:
    """The machine's ledger: which application's master holds which GPU indices and how much
    memory, and which wait, in the order they asked."""

    def __init__(self, path=None):
        self.path = path or os.environ.get("YARNAPP_LEDGER") or os.environ.get("YARNAPP_GPU_LEDGER") or \
            os.path.join(tempfile.gettempdir(), "yarnapp-leases", "leases.json")      # (GPU_LEDGER: its old name)

    @contextlib.contextmanager
    def _locked(self):
        """The ledger, read and written back in place under the lock: every user's engine
        writes it, and in the sticky folder only a file's owner may rename over it."""
        folder = os.path.dirname(self.path)
        if not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            with contextlib.suppress(OSError):      # every user's engine writes it (as /tmp is)
                os.chmod(folder, 0o1777)
        with _open_own(self.path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with _open_own(self.path) as f:
                    f.seek(0)
                    try:
                        ledger = json.loads(f.read() or "{}")
                    except ValueError:
                        ledger = None
                    if not isinstance(ledger, dict):        # (a hand's edit, a writer killed mid-write)
                        log.warning("the machine's ledger %s is not one: its leases are forgotten", self.path)
                        ledger = {}
                    # a lease or a place in line whose processes are all gone is free again
                    ledger = {part: {app: v for app, v in (ledger.get(part) or {}).items()
                                     if isinstance(v, dict) and _alive(v)} for part in ("held", "waiting")}
                    yield ledger
                    f.seek(0)
                    f.truncate()
                    f.write(json.dumps(ledger))
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def acquire(self, app_id, count=0, gpus=(), memory=0, capacity=None, pids=None):
        """Lease `count` GPUs of inventory `gpus` and `memory` MiB of the machine's `capacity`
        (None: not counted) to app_id: (its GPU indices, [], [], []), or (None, whose leases
        stand in the way, the applications in line before it, what it waits for: "gpus",
        "memory") when it must wait: too few GPUs or too little memory are free now, or
        another waits for what it would take. The lease (and the place in line) lasts while
        any of `pids` lives (default this process; pid 1, an orphan's parent, is no holder)."""
        procs = [[p, psutil.Process(p).create_time()] for p in dict.fromkeys(pids or [os.getpid()])
                 if p > 1 and psutil.pid_exists(p)]
        owner = _owner()            # (not under the machine's lock: a user lookup may be slow)
        with self._locked() as ledger:
            held, waiting = ledger["held"], ledger["waiting"]
            if app_id in held:
                return held[app_id]["gpus"], [], [], []
            me = waiting.setdefault(app_id, {"since": time.time()})
            me["procs"] = procs                 # (a restarted master's, its supervisor's)
            me["owner"] = owner
            free = [g.index for g in gpus if g.index not in {i for v in held.values() for i in v["gpus"]}]
            short = ["gpus"] * (len(free) < count) + ["memory"] * (
                capacity is not None and sum(v.get("memory", 0) for v in held.values()) + memory > capacity)
            ahead = sorted((w["since"], app) for app, w in waiting.items() if app != app_id and w["since"] < me["since"]
                           and ("gpus" in w.get("short", ()) and count or "memory" in w.get("short", ()) and memory))
            # In line only, it waits for what those ahead wait for: a later one does not pass it either.
            short = short or sorted({r for _, app in ahead for r in waiting[app].get("short", ())
                                     if r == "gpus" and count or r == "memory" and memory})
            me["short"] = short
            if ahead or short:
                return None, sorted(app for app, v in held.items() if "gpus" in short and v["gpus"]
                                    or "memory" in short and v.get("memory")), [app for _, app in ahead], short
            waiting.pop(app_id)
            held[app_id] = {"procs": procs, "gpus": free[:count], "memory": memory, "owner": me["owner"]}
            return free[:count], [], [], []

    def whose(self, apps):
        """`apps` as a waiting user can look them up: an id, and where it is another's or in
        another YARNAPP_HOME, whose and where (`yarnapp status ID` there finds it)."""
        mine = _owner()
        with self._locked() as ledger:
            entries = {**ledger["waiting"], **ledger["held"]}
        out = []
        for app in apps:
            entry = entries.get(app)
            owner = entry.get("owner") if isinstance(entry, dict) else None
            owner = owner if isinstance(owner, dict) else {}        # (an older engine's entry: none)
            user, home = owner.get("user", mine["user"]), owner.get("home", mine["home"])
            where = [f"{user}'s"] * (user != mine["user"]) + [f"in YARNAPP_HOME {home}"] * (home != mine["home"])
            out.append(f"{app} ({', '.join(map(str, where))})" if where else app)
        return out

    def release(self, app_id):
        with self._locked() as ledger:
            ledger["held"].pop(app_id, None)
            ledger["waiting"].pop(app_id, None)

    def held(self):
        """{application: {"gpus": indices, "memory": MiB}} of the leases held now."""
        with self._locked() as ledger:
            return {app: {"gpus": v["gpus"], "memory": v.get("memory", 0)} for app, v in ledger["held"].items()}


def _owner():
    """Who asks, as another user reads it: the user (by the process's uid, not $USER) and
    YARNAPP_HOME."""
    import pwd

    from .state import home
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = f"uid {os.geteuid()}"
    return {"user": user, "home": os.path.realpath(home())}


def _alive(entry):
    """Whether any process of a lease or a place in line lives (the same process: its pid
    and its start time; a pid of the old ledger's entries alone)."""
    for pid, started in entry.get("procs") or ([[entry["pid"], None]] if entry.get("pid") else []):
        try:
            if psutil.pid_exists(pid) and (started is None or abs(psutil.Process(pid).create_time() - started) < 1.0):
                return True
        except psutil.Error:        # gone meanwhile
            continue
    return False


def machine_memory_mib():
    """The memory the local engine offers: the machine's."""
    return psutil.virtual_memory().total // 2**20
