"""The local engine's zygote: the containers' warm processes forked from one that imported once.

A container's warm process (launcher.warm) imports torch and the training modules once for
every generation of its ranks, but each container still paid that import: about 2 CPU-seconds,
4-6 s of wall time under a container's half-vcore quota, three times over for a job of three
containers on one machine, before its world could form. The application master now starts one
*zygote* for the containers whose ranks would import alike (`python -m launcher.zygote`, in
their environment), which does those imports, then forks each container's warm process when
its agent asks: the fork takes on the container (its cgroups: CPU quota and memory limit;
its process group, resource limits, niceness, CPU affinity, umask, working directory,
stdout and stderr, environment) and serves its agent exactly as a warm process the agent started would
(launcher.warm.loop). A job's world forms once the zygote has imported, whatever the
containers' quotas; the import's CPU is the master's, not a container's.

Whose environment is alike (`key`): every variable but the container's own (YARNAPP_*, which
no library reads as it is imported; CUDA_VISIBLE_DEVICES, read when CUDA starts, never in the
zygote) and PYTHONPATH's working directory, which the fork puts in its sys.path in the
zygote's place. A group's own OMP_NUM_THREADS, MALLOC_* or LD_PRELOAD (read as libraries
load) makes another key: the master starts a zygote per key that two or more containers share,
and none for containers in an emulated node's network namespace. An agent checks the key
against the zygote's own environment before it asks, and starts its own warm process where it
differs or the zygote is gone (before or after forking it: launcher.warm.Warm).

Lifetimes: the zygote dies with its master (PR_SET_PDEATHSIG); its forks do not (a zygote
killed, say for the machine's memory, would take every container's rank along). A fork is no
child of its agent: it ends when its agent's pipe closes, killing its rank
(launcher.warm._wait_rank), and the agents die with the master. It joins its agent's process group (the master starts agents and
zygotes in its own session for that), so that a container's processes are signalled, stopped
and killed together, as before.

Memory: a fork holds as much memory of its own as the zygote's imports made (`_ballast`), so
that its container's cgroup is charged as if it had imported itself: a container holds what
it held before on the local engine (a container too small to import torch fails here as on
YARN, whose NodeManager counts every process's resident pages). The zygote saves the imports'
CPU and time, not memory.

Protocol: SOCK_SEQPACKET socketpairs. The master sends the zygote one end of a new pair per
container it starts (SCM_RIGHTS) and passes the other to the agent (YARNAPP_ZYGOTE="FD PID");
an agent sends one message per warm process it wants, {"env", "cwd", "agent": its pid}, with five fds: its
stdin, stdout and stderr, and the two pipes of launcher.warm's protocol. The zygote never
answers: the fork says its pid on the pipe (`warm PID`), and a refusal closes the pipes.

    python -m launcher.zygote CONTROL_FD
"""
import contextlib
import ctypes
import gc
import json
import logging
import mmap
import os
import resource
import selectors
import socket
import subprocess
import sys
import traceback

from . import procs
from .procs import die_with_parent

log = logging.getLogger("launcher.zygote")

OWN = ("CUDA_VISIBLE_DEVICES",)        # besides YARNAPP_*: a container's own, read after the imports
CGROUPS = "/sys/fs/cgroup"


def key(env, cwd):
    """What of a warm process's environment its imports may read, as a comparable dict."""
    out = {}
    for k, v in env.items():
        if k.startswith("YARNAPP_") or k in OWN:
            continue
        if k == "PYTHONPATH":
            v = os.pathsep.join("{cwd}" if p == cwd else p for p in v.split(os.pathsep))
        out[k] = v
    return out


def differs(a, b):
    """The names whose values differ between two keys (for the log)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


# -- the master's side -------------------------------------------------------------------------
class Zygote:
    """One zygote process of an application master, and the sockets its containers' agents get."""

    def __init__(self, env, cwd):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.zygote", str(theirs.fileno())], cwd=cwd,
                                     env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     preexec_fn=_own_group)
        theirs.close()
        self.pid = self.proc.pid

    def connect(self):
        """A socket for one agent (passed to it, then closed here: YARNAPP_ZYGOTE), or None
        where the zygote is gone."""
        if self.proc.poll() is not None:
            return None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self.control, [b"agent"], [theirs.fileno()])
        except OSError:
            mine.close()
            return None
        finally:
            theirs.close()
        return mine

    def stop(self):
        self.control.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _own_group():
    """preexec_fn: a process group of its own in the master's session, as its agents have (a
    fork joins its agent's group: only within one session), and dying with the master."""
    os.setpgid(0, 0)
    die_with_parent()


# -- the agent's side --------------------------------------------------------------------------
class Client:
    """An agent's socket to its application's zygote."""

    def __init__(self, fd, pid):
        self.sock, self.pid = socket.socket(fileno=fd), pid

    @classmethod
    def from_env(cls):
        """From YARNAPP_ZYGOTE ("FD PID", set by the local master), taken out of the
        environment (a rank has no business with it); None without one."""
        spec = os.environ.pop("YARNAPP_ZYGOTE", None)
        if not spec:
            return None
        fd, pid = (int(x) for x in spec.split())
        return cls(fd, pid)

    def fork_warm(self, env, cwd, r_cmd, w_out):
        """Ask the zygote for a warm process with `env` in `cwd` serving these pipes. False
        (nothing asked) where its environment is not alike, or it is gone."""
        try:
            with open(f"/proc/{self.pid}/environ", "rb") as f:
                theirs = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            theirs = {k.decode(errors="surrogateescape"): v.decode(errors="surrogateescape")
                      for k, v in theirs.items()}
            their_cwd = os.readlink(f"/proc/{self.pid}/cwd")
        except OSError:
            return False
        mismatch = differs(key(theirs, their_cwd), key(env, cwd))
        if mismatch:
            log.info("starting a warm process of this container's own: its environment differs from the "
                     "zygote's in %s", ", ".join(mismatch))
            return False
        try:
            socket.send_fds(self.sock, [json.dumps({"env": dict(env), "cwd": cwd, "agent": os.getpid()}).encode()],
                            [0, 1, 2, r_cmd, w_out])
        except OSError:
            return False
        return True


# -- the zygote --------------------------------------------------------------------------------
_started = {}     # the zygote's environment as it started (its imports may add to it: sklearn's KMP_*)


def serve(control_fd):
    from . import identity, warm
    die_with_parent()
    _started.update(os.environ)
    control = socket.socket(fileno=control_fd)
    warm.prepare(identity.job_from_env(), os.getcwd())
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    gc.freeze()                          # what the imports made stays shared with the forks, never collected
    while True:                          # (and the forks that ended are reaped, once a second at most)
        for k, _ in sel.select(timeout=1):
            sock = k.fileobj
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
            except OSError:
                msg, fds = b"", []
            if sock is control:
                if not msg:
                    return                                   # the master is gone
                for fd in fds:
                    sel.register(socket.socket(fileno=fd), selectors.EVENT_READ)
                continue
            if not msg:                                      # the agent is gone
                sel.unregister(sock)
                sock.close()
            elif len(fds) == 5:
                try:
                    _fork(sel, sock, json.loads(msg), fds)
                except Exception:  # noqa: BLE001 - one agent's request (a fork refused: EAGAIN), not the others'
                    log.exception("could not fork a warm process; its agent starts its own")
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def _fork(sel, sock, order, fds):
    """Fork a warm process for the agent at the other end of `sock`."""
    mismatch = differs(key(_started, os.getcwd()), key(order["env"], order["cwd"]))
    if mismatch:                         # (the agent checks first: refused, its pipes close)
        log.warning("refused a warm process whose environment differs in %s", ", ".join(mismatch))
        return
    agent = order["agent"]               # (not SO_PEERCRED: a socketpair's is its maker's, the master)
    size = _anonymous()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork():
        return
    code = 1
    try:
        for k in list(sel.get_map().values()):
            k.fileobj.close()
        sel.close()
        log.handlers.clear()
        # (no parent-death signal: a zygote that dies, say killed for the machine's memory, does
        # not take its forks along; each ends with its agent, which dies with the master)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        take_on(agent)
        os.setpgid(0, os.getpgid(agent))     # its process group: signalled, stopped, killed as the container
        _ballast(size)
        zygote_cwd = os.getcwd()
        os.chdir(order["cwd"])
        sys.path[:] = [order["cwd"] if p == zygote_cwd else p for p in sys.path]
        imported = {k: v for k, v in os.environ.items() if _started.get(k) != v}
        os.environ.clear()
        os.environ.update(order["env"])
        for k, v in imported.items():    # what the imports set, as they would have in its environment
            os.environ.setdefault(k, v)
        from . import warm
        warm.loop(fds[3], fds[4])
        code = 0
    except BaseException:  # noqa: BLE001 - never back into the zygote's loop
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def take_on(pid):
    """Become part of process `pid`'s container: its cgroups (v1), resource limits,
    niceness, CPU affinity, OOM score and umask."""
    mine = _cgroups(os.getpid())
    for controllers, path in _cgroups(pid).items():
        if path != mine.get(controllers) and controllers and not controllers.startswith("name="):
            with open(os.path.join(CGROUPS, controllers, path.lstrip("/"), "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            which = getattr(resource, name)
            want = resource.prlimit(pid, which)
            if resource.getrlimit(which) != want:
                resource.setrlimit(which, want)
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, pid))
    os.sched_setaffinity(0, os.sched_getaffinity(pid))
    with open(f"/proc/{pid}/oom_score_adj") as f, open("/proc/self/oom_score_adj", "w") as g:
        g.write(f.read())
    with open(f"/proc/{pid}/status") as f:
        umask = next((line.split()[1] for line in f if line.startswith("Umask:")), None)
    if umask is not None:
        os.umask(int(umask, 8))


def _anonymous():
    """This process's anonymous resident memory (bytes): what its imports made."""
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)


def _ballast(size):
    """Charge this container as if it had imported itself: `size` bytes of its own, touched,
    and not inherited by its ranks (MADV_DONTFORK; through libc: a Python mmap object, in a
    rank where the mapping is not, would unmap whatever lay there at its exit). The imports'
    pages are the zygote's cgroup's; without this, a container too small to import torch
    trained on the local engine, and failed on YARN."""
    if size <= 0:
        return
    libc = procs._LIBC
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the ballast failed")
    libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), mmap.MADV_DONTFORK)
    ctypes.memset(addr, 1, size)


def _cgroups(pid):
    """{controllers: path} of a process's cgroup v1 hierarchies."""
    out = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers:
                out[controllers] = path
    return out


if __name__ == "__main__":
    # (its own logger's handler, not the root's: the root logger is the job's code's in every fork)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    serve(int(sys.argv[1]))
