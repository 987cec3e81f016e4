"""Warm restarts: a container's ranks forked from a process that did their imports once.

A rank process spends most of its start importing torch and the training modules (about
2 CPU-seconds, 4 s of wall time in a container of 0.5 vcores), and every restart of a
generation paid it again in every container, so that a world re-formed after a rank's
crash no sooner than a fresh application's. The agent now starts one *warm* process per
container (`python -m launcher.warm`, in the rank's environment), which imports those
modules and then forks a rank for each generation it is asked for: `launcher.rank.main`
runs in the fork as it would in a fresh process. MPI is initialised only in the fork
(the warm process never imports `mpi4py.MPI`), nor is CUDA: it imports, it does not
compute. The fork's pages are the warm process's until written (copy on write, and
gc.freeze() keeps the collector from writing them), so a container's memory cgroup grows by
what the rank writes, not by a second torch. The local engine's containers only: YARN's
NodeManager adds up each process's resident memory, shared pages in each (launcher.agent).

Where the application master started a zygote for the containers alike (launcher.zygote), the
warm process is forked from it instead of started: imported once for those containers, not
once each.

Protocol (two pipes, so that the rank's stdout and stderr stay the container log's):
the agent writes a JSON line per rank ({"generation", "heartbeat"}); the warm process says
`warm PID` first, answers `pid PID` once it has forked, and `exit PID STATUS` (a Popen
returncode: negative for a signal) when that rank ends; it ends when the agent's pipe
closes, killing a rank still running (_wait_rank). One rank at a time. The agent's side is `WarmRank`, shaped
like the `subprocess.Popen` it replaces. A warm process killed with its rank (say for memory)
is started again for the next generation; one that failed before forking (its own error)
has that rank, and every later one, started afresh as before."""
import ast
import contextlib
import gc
import importlib
import importlib.machinery
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import traceback

from . import exitcodes, malloc
from .procs import die_with_parent, parent_pid

log = logging.getLogger("launcher.warm")

# Libraries whose import is long and has no side effects a rank would miss: pre-imported where the
# job's code imports them at its top (a user's own modules are not: their top level runs per rank).
LIBRARIES = ("torch", "torchvision", "numpy", "pyarrow", "pandas", "PIL", "sklearn", "training")


def imports(job, workdir):
    """What the warm process imports: the modules a rank of `job` imports anyway before its
    first step, and nothing more (a job whose code does not import torch pays nothing for
    it): yarnapp's own entry module (the built-in runner: torch, pyarrow...), or the
    LIBRARIES that the user's script or function module imports at its top, before any other
    statement (one that sets the environment or sys.path may change how a library loads)."""
    run = job.run
    if run.function and run.function.split(".")[0] == "training":
        return [run.function.split(":")[0]]
    if run.pickle:
        return _pickled(os.path.join(workdir, run.pickle))
    path = None
    if run.script:
        path = os.path.join(workdir, run.script)
    elif run.function:
        path = _source_of(run.function.split(":")[0], workdir)
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (TypeError, OSError, SyntaxError, ValueError):
        return []                        # a pickled function, or code the rank will fail on itself
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue                 # the docstring
            break                        # `os.environ[...] = `, `sys.path.insert(...)`: libraries below
                                         # it load as the code has them load, after it
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] + [f"{node.module}.{a.name}" for a in node.names]    # a submodule, if it is one
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found += [n for n in names if n.split(".")[0] in LIBRARIES and n not in found]
    return found


def environment(environ, group_env, info, cwd, **extra):
    """A rank's environment (and its warm process's): `environ` and `extra`, with its vcores'
    threads (torchrun sets 1), unless its group's env sets them (not the submitting shell's:
    a laptop's OMP_NUM_THREADS=8 is not for a 1-vcore container), its working directory
    (the user's shipped code, yarnapp.shipping) importable, and launcher.malloc's settings.
    `info`: its entry of JobSpec.ranks()."""
    threads = str(info["omp_threads"] or max(1, math.ceil(info["vcores"])))
    path = os.pathsep.join(p for p in (cwd, environ.get("PYTHONPATH")) if p)
    return malloc.environment(dict(environ, **extra, OMP_NUM_THREADS=threads, PYTHONPATH=path,
                                   MKL_NUM_THREADS=group_env.get("MKL_NUM_THREADS", threads)))


def _pickled(path):
    """The libraries a pickled function (a notebook's: cloudpickle) names, which loading it
    imports anyway: cloudpickle names the modules a function uses by value as strings ("torch"),
    and a function of a module by its module's name. Third-party libraries only (yarnapp's own
    modules are not imported before MPI is), and their top-level packages."""
    import pickletools
    try:
        with open(path, "rb") as f:
            ops = list(pickletools.genops(f.read()))
    except Exception:  # noqa: BLE001 - unreadable: the rank names it
        return []
    found = []
    for _, arg, _ in ops:
        if isinstance(arg, str):
            top = arg.split(" ")[0].split(".")[0]       # (GLOBAL's argument: "module name")
            if top in LIBRARIES and top != "training" and top not in found:
                found.append(top)
    return found


class WarmRank:
    """The agent's handle on one rank forked by the warm process: pid, poll, wait, kill,
    returncode, as subprocess.Popen's. Made at once; its pid arrives once the warm process
    has done its imports and forked. Where the warm process fails before forking it (an
    error of its own: it is not the rank's), the rank is started afresh, as a Popen."""

    def __init__(self, warm, argv, env):
        self._warm, self._argv, self._env = warm, argv, env
        self._pid, self.returncode, self._popen = None, None, None

    @property
    def pid(self):
        while self._pid is None and self.returncode is None and self._popen is None:
            self._warm.read(block=True)
        return self._popen.pid if self._popen is not None else self._pid

    def afresh(self):
        log.warning("the warm process ended before it started this rank (%s); starting it afresh",
                    f"exit status {self._warm.proc.poll()}" if self._warm.proc is not None else "forked by the zygote")
        self._popen = subprocess.Popen(self._argv, env=self._env, preexec_fn=die_with_parent)

    def poll(self):
        if self._popen is not None:
            self.returncode = self._popen.poll()
        elif self.returncode is None:
            self._warm.read(block=False)
        return self.returncode

    def wait(self):
        while self._popen is None and self.returncode is None:
            self._warm.read(block=True)
        if self._popen is not None:
            self.returncode = self._popen.wait()
        return self.returncode

    @property
    def started_pid(self):
        """The rank's pid once it runs, never waiting (None while the warm process imports)."""
        return self._popen.pid if self._popen is not None else self._pid

    def waitable(self):
        """(pids, fds) to wait on for its end: the warm process's pipe, where its pid and its
        end are said; the pid of a rank started afresh."""
        if self._popen is not None:
            return [self._popen.pid], []
        return [], [self._warm._out] if self._warm._out is not None else []

    def kill(self):
        if self.poll() is not None:
            return
        if self._popen is not None:
            self._popen.kill()
        elif self._pid is None:          # still importing: stop the warm process, not wait for it
            self._warm.close()
            self.returncode = -signal.SIGKILL
        else:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def waitable(child):
    """(pids, fds) to wait on for a rank process's end (launcher.procs.wait_exit): a Popen's
    pid; a WarmRank's warm process's pipe, where its pid and its end are said."""
    if isinstance(child, WarmRank):
        return child.waitable()
    pid = getattr(child, "pid", None)
    return ([pid] if pid else []), []


def started_pid(child):
    """A rank process's pid once it runs, never waiting: a Popen's, or a WarmRank's once
    forked (None while the warm process imports, or without a child)."""
    return child.started_pid if isinstance(child, WarmRank) else getattr(child, "pid", None)


class Warm:
    """The agent's side: starts the warm process (or has the application's zygote fork one:
    launcher.zygote), forks ranks through it."""

    def __init__(self, env, zygote=None):
        r_cmd, w_cmd = os.pipe()
        r_out, w_out = os.pipe()
        self.proc = None                 # the warm process this agent started (a Popen), or
        self.pid, self._pidfd = None, None   # ... the one the zygote forked (said on its pipe)
        self.zygote = zygote if zygote is not None and zygote.fork_warm(env, os.getcwd(), r_cmd, w_out) else None
        if self.zygote is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "launcher.warm", str(r_cmd), str(w_out)],
                                         env=env, pass_fds=(r_cmd, w_out), preexec_fn=die_with_parent)
            self.pid = self.proc.pid
        os.close(r_cmd)
        os.close(w_out)
        self._cmd, self._out = os.fdopen(w_cmd, "w", buffering=1), r_out
        self._buf, self.rank, self.failed, self.gone = b"", None, False, False
        self.zygote_failed = False       # the zygote's warm process ended before forking: start our own next

    @property
    def importer(self):
        """The pid of the process that imports for the rank to come: this warm process, or the
        zygote while it has not forked one yet."""
        return self.pid or (self.zygote.pid if self.zygote is not None else None)

    def alive(self):
        if self.proc is not None:
            return self.proc.poll() is None and not self.gone
        if not self.gone:
            self.read(block=False)
        return not self.gone

    def spawn(self, gen, heartbeat, argv, env):
        """A rank of generation `gen` (argv and env: as it would be started afresh), to be
        forked by the warm process: a WarmRank."""
        self.rank = WarmRank(self, argv, env)
        try:
            self._cmd.write(json.dumps({"generation": gen, "heartbeat": heartbeat}) + "\n")
        except OSError:
            self._ended()
        return self.rank

    def read(self, block):
        """Take in what the warm process said: a rank's pid, or its end (its returncode)."""
        while True:
            try:
                line = self._line(block)
            except EOFError:
                self._ended()
                return
            if line is None:
                return
            word, pid, *status = line.split()
            if word == "warm":           # forked by the zygote: its pid (to stop it by, see close)
                self._forked(int(pid))
                continue
            if self.rank is None:
                return
            if word == "pid":            # the rank asked for last (an earlier one's exit was read before)
                self.rank._pid = int(pid)
                if not block:
                    continue
                return
            if word == "exit" and int(pid) == self.rank._pid:
                self.rank.returncode = int(status[0])
                return

    def _forked(self, pid):
        """The zygote's warm process said its pid: held as a pidfd (it is not our child: its pid,
        once the zygote reaps it, may be another process's), if it is still the zygote's child."""
        if self.zygote is None:
            return                       # (ours: its pid is the Popen's)
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        if parent_pid(pid) != self.zygote.pid:
            os.close(fd)
            return
        self.pid, self._pidfd = pid, fd

    def _ended(self):
        """The warm process is gone: its rank died with it (PDEATHSIG), or, not forked yet, starts afresh."""
        self.gone = True
        rank = self.rank
        if rank is not None and rank.returncode is None and rank._popen is None:
            if rank._pid is None:
                if self.zygote is not None:
                    self.zygote_failed = True    # (the zygote's own trouble: this agent starts its own next)
                else:
                    self.failed = True   # an error of the warm process's own: ranks start afresh from now on
                rank.afresh()
            else:
                rank.returncode = -signal.SIGKILL

    def _line(self, block):
        while b"\n" not in self._buf:
            if not block and not select.select([self._out], [], [], 0)[0]:
                return None
            chunk = os.read(self._out, 4096)
            if not chunk:
                raise EOFError("the warm process ended")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def close(self):
        self.gone = True
        try:
            self._cmd.close()
        except OSError:
            pass
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        elif self._pidfd is not None:    # (its pipe closed, it would end by itself: at once, its rank too)
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            os.close(self._pidfd)
            self._pidfd = None
        if self._out is not None:       # (left open, one fd leaked with every warm process restarted)
            os.close(self._out)
            self._out = None


def _source_of(module, workdir):
    """The file of `module`, found without importing it or its packages (importlib.util.find_spec
    would run a package's __init__ here, once for every rank to come)."""
    spec, path = None, [workdir, *sys.path]     # (the master's sys.path lacks the job's code)
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return spec.origin


def prepare(job, workdir):
    """Import what a rank of `job` imports anyway (imports), and launcher.rank; never MPI."""
    from . import rank  # noqa: F401 - once here, not in every fork
    for name in imports(job, workdir):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this environment lacks: the rank meets it, if it needs it
            pass
    assert "mpi4py.MPI" not in sys.modules, "the warm process must not initialise MPI"


class _Commands:
    """The agent's command lines, read from its pipe (a raw fd: see _wait_rank)."""

    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def next(self):
        """The next line, or None once the agent closed its end (or died)."""
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def _wait_rank(pid, commands):
    """The rank's exit status (a Popen returncode). Should the agent go first (its pipe ends:
    killed, or frozen and replaced), the rank is killed and this process ends: a warm process
    the zygote forked is not the agent's child, and does not die with it by itself."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = None
    while pidfd is not None:
        ready = select.select([pidfd, commands.fd], [], [])[0]
        if pidfd in ready:
            os.close(pidfd)
            break
        chunk = os.read(commands.fd, 4096)
        if not chunk:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)
        commands.buf += chunk
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def loop(cmd_fd, out_fd):
    """Fork a rank per `spawn` line until the agent closes the pipe."""
    from . import rank
    os.write(out_fd, f"warm {os.getpid()}\n".encode())
    commands = _Commands(cmd_fd)
    gc.freeze()                          # what the imports made is never collected: its pages stay shared
    while (line := commands.next()) is not None:
        order = json.loads(line)
        gen = str(order["generation"])
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)     # (ignored by the warm process, below)
            os.close(cmd_fd)
            os.close(out_fd)
            die_with_parent()
            if os.getppid() != parent:   # the warm process died before that took hold
                os._exit(exitcodes.RANK_FAILED)
            if "numpy" in sys.modules:   # a fresh process's unseeded draws differ each time (random: reseeded by Python)
                sys.modules["numpy"].random.seed()
            os.environ["YARNAPP_GENERATION"] = gen
            sys.argv = [sys.argv[0], "--generation", gen, "--heartbeat", order["heartbeat"]]
            try:
                rank.main(sys.argv[1:])          # ends the process itself (os._exit)
                code = 0
            except SystemExit as e:              # as the interpreter ends on it
                code = e.code
                if code is None:
                    code = 0
                elif not isinstance(code, int):
                    print(code, file=sys.stderr)
                    code = 1
            except BaseException:  # noqa: BLE001 - never back into the warm process's loop
                traceback.print_exc()
                code = exitcodes.RANK_FAILED
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        # A container stopped with SIGTERM: its rank may end on its own (a handler of the user's);
        # this process, dying first, took it along at once (its parent-death signal is SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(out_fd, f"pid {pid}\n".encode())
        code = _wait_rank(pid, commands)
        os.write(out_fd, f"exit {pid} {code}\n".encode())


def serve(cmd_fd, out_fd):
    """The warm process: import, then fork a rank per `spawn` line until the agent closes the pipe."""
    from . import identity
    prepare(identity.job_from_env(), os.getcwd())
    loop(cmd_fd, out_fd)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
