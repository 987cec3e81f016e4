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

Protocol (two pipes, so that the rank's stdout and stderr stay the container log's):
the agent writes a JSON line per rank ({"generation", "heartbeat"}); the warm process answers
`pid PID` once it has forked, and `exit PID STATUS` (a Popen returncode: negative for a
signal) when that rank ends. One rank at a time. The agent's side is `WarmRank`, shaped
like the `subprocess.Popen` it replaces. A warm process killed with its rank (say for memory)
is started again for the next generation; one that failed before forking (its own error)
has that rank, and every later one, started afresh as before."""
import ast
import gc
import importlib
import importlib.machinery
import json
import logging
import os
import select
import signal
import subprocess
import sys
import traceback

from . import exitcodes
from .procs import die_with_parent

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
    path = None
    if run.script:
        path = os.path.join(workdir, run.script)
    elif run.function:
        path = _source_of(run.function.split(":")[0])
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
        log.warning("the warm process ended before it started this rank (exit status %s); starting it afresh",
                    self._warm.proc.poll())
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
    """The agent's side: starts the warm process, forks ranks through it."""

    def __init__(self, env):
        r_cmd, w_cmd = os.pipe()
        r_out, w_out = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.warm", str(r_cmd), str(w_out)],
                                     env=env, pass_fds=(r_cmd, w_out), preexec_fn=die_with_parent)
        os.close(r_cmd)
        os.close(w_out)
        self._cmd, self._out = os.fdopen(w_cmd, "w", buffering=1), r_out
        self._buf, self.rank, self.failed = b"", None, False

    def alive(self):
        return self.proc.poll() is None

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
            if line is None or self.rank is None:
                return
            word, pid, *status = line.split()
            if word == "pid":            # the rank asked for last (an earlier one's exit was read before)
                self.rank._pid = int(pid)
                if not block:
                    continue
                return
            if word == "exit" and int(pid) == self.rank._pid:
                self.rank.returncode = int(status[0])
                return

    def _ended(self):
        """The warm process is gone: its rank died with it (PDEATHSIG), or, not forked yet, starts afresh."""
        rank = self.rank
        if rank is not None and rank.returncode is None and rank._popen is None:
            if rank._pid is None:
                self.failed = True       # an error of the warm process's own: ranks start afresh from now on
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
        try:
            self._cmd.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self._out is not None:       # (left open, one fd leaked with every warm process restarted)
            os.close(self._out)
            self._out = None


def _source_of(module):
    """The file of `module`, found without importing it or its packages (importlib.util.find_spec
    would run a package's __init__ here, once for every rank to come)."""
    spec, path = None, None
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return spec.origin


def serve(cmd_fd, out_fd):
    """The warm process: import, then fork a rank per `spawn` line until the agent closes the pipe."""
    from . import identity, rank         # once here, not in every fork
    for name in imports(identity.from_env().job, os.getcwd()):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this environment lacks: the rank meets it, if it needs it
            pass
    assert "mpi4py.MPI" not in sys.modules, "the warm process must not initialise MPI"
    commands = os.fdopen(cmd_fd, "r")
    gc.freeze()                          # what the imports made is never collected: its pages stay shared
    for line in commands:
        order = json.loads(line)
        gen = str(order["generation"])
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)     # (ignored by the warm process, below)
            commands.close()
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
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        os.write(out_fd, f"exit {pid} {code}\n".encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
