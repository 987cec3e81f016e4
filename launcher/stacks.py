"""Where a hung rank is: its Python stack, dumped on request.

The rank process registers faulthandler for SIGUSR1 (`enable`): its C handler writes
every thread's Python stack to a file, whatever the rank is doing (a busy loop, a blocking
MPI call), without needing the GIL. When a rank's heartbeat goes silent, its agent asks
for the dump (`dump`) and reads where the main thread is (`where`): the frame goes into
the failure's reason, and a rank found waiting for its peers (in a collective) is given
time for the rank it waits on, the one still computing, to be named first. Each agent
judges only its own rank; before, every silent rank named itself at the same moment, and
whichever wrote first was blamed.
"""
import dataclasses
import faulthandler
import linecache
import os
import re
import signal
import sys
import time

from conf.schema import PACKAGES

SUFFIX = ".stack"      # a rank's dump file: its heartbeat file's path and this
WAITING_GRACE_S = 5.0  # a rank found waiting is declared hung this much later (at most its limit):
                       # time for the agent of the rank it waits on to dump that one's stack and say so
# A main thread with a frame in one of these waits for its peers.
WAITING = ("training/collectives/", "torch/distributed/", "mpi4py/")
WAITING_IF_IDLE = ("torch/autograd/",)      # ... and, using no CPU, so does one in backward (where)
# ... and so does one whose innermost frame calls a communicator's blocking method (or waits
# on requests): mpi4py's are C code, so `ctx.comm.Barrier()` leaves no frame of mpi4py's (its
# line tells; the receiver must be named like a communicator, so torch's x.gather(...) is not).
_MPI_CALL = re.compile(r"(?i:comm)\w*\.([Bb]arrier|[Bb]cast|[Aa]llreduce|[Rr]educe|[Rr]educe_scatter|[Gg]atherv?|"
                       r"[Aa]llgatherv?|[Ss]catterv?|[Aa]lltoallv?|[Rr]ecv|M[Rr]ecv|[Ss]endrecv|[Ss]s?end|[Pp]robe)"
                       r"\s*\(|Request\.[Ww]ait(all|any|some)?\s*\(")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')


def enable(path):
    """Rank side: dump every thread's stack to `path` on SIGUSR1 (the file stays open, in
    append mode: each dump lands at the start of the file `dump` truncated)."""
    faulthandler.register(signal.SIGUSR1, file=open(path, "a"), all_threads=True, chain=False)
    # ... and on a fatal signal (a segfault, a C++ exception nothing caught), to its log
    # (launcher.failure.native_crash reads where the main thread was)
    faulthandler.enable(file=sys.__stderr__, all_threads=True)


def dump(pid, path, timeout=1.0):
    """Agent side: the stack dump of process `pid` (which called `enable(path)`), or None
    when none comes within `timeout` (a process that registered nothing dies of SIGUSR1,
    which is what would have been done to a hung rank anyway)."""
    try:
        os.truncate(path, 0)
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return None
    deadline, size = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = os.path.getsize(path)
        except OSError:
            return None
        if now and now == size:             # written, and no longer growing
            with open(path, errors="replace") as f:
                return f.read()
        size = now
    return None


@dataclasses.dataclass(frozen=True)
class Where:
    frame: str          # the main thread's innermost frame: "file:line in function"
    waiting: bool       # the main thread is inside a collective (a frame in WAITING)
    caller: str = ""    # its innermost frame in the user's own code, where that is not `frame`

    def describe(self):
        """"<the user's frame> (in <the innermost frame>)", or the innermost frame alone."""
        return f"{self.caller} (in {self.frame})" if self.caller else self.frame


def ours_or_library(path):
    """A frame of yarnapp's own packages, of an installed library or of Python itself."""
    return "/site-packages/" in path or "/dist-packages/" in path or path.startswith(_LIBRARIES) or \
        any(path.startswith(os.path.join(_ROOT, pkg) + os.sep) for pkg in PACKAGES) or path.startswith("<")


def users_frame(frames):
    """The innermost of `frames` ((path, line, function), innermost first) in the user's own
    code: a file of theirs, else code they ran from a string (exec, python -c, a notebook
    cell), which only counts where no file of theirs lies further out (a dataclass's
    generated __init__ is "<string>" too); or None."""
    frames = list(frames)
    return next((f for f in frames if not ours_or_library(f[0])), None) or \
        next((f for f in frames if f[0].startswith(_USERS_PSEUDO)), None)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # this checkout (or install)
_USERS_PSEUDO = ("<string>", "<stdin>", "<ipython-input-")     # code run from a string or a cell (users_frame;
                                                                # not <frozen runpy>, torch.fx's <eval_with_key>.0)
_LIBRARIES = tuple(p for p in {os.path.dirname(os.__file__)} if p)       # the standard library


def where(text, idle=False):
    """The main thread's innermost frame in a faulthandler dump, or None: the thread that
    runs launcher/rank.py and was not started by `threading` (the liveness thread runs
    rank.py's code too), else the thread that took the signal. idle: the rank used no CPU
    while silent (launcher.monitor's busy), so a main thread in autograd's backward waits too:
    DistributedDataParallel's all-reduce runs in C++, under loss.backward()."""
    if not text:
        return None
    threads, current = [], None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            current = []
            threads.append((line.startswith("Current"), current))
        elif current is not None:
            m = _FRAME.match(line)
            if m:
                current.append(m.groups())
    main = next((frames for _, frames in threads if frames and not frames[-1][0].endswith("threading.py")
                 and any(path.endswith("launcher/rank.py") for path, _, _ in frames)), None)
    if main is None:
        main = next((frames for taken, frames in threads if taken and frames), None)
    if not main:
        return None
    path, line, fn = main[0]
    calls_mpi = bool(_MPI_CALL.search(linecache.getline(path, int(line))))
    user = users_frame(main)
    caller = f"{user[0]}:{user[1]} in {user[2]}" if user and user != main[0] else ""
    return Where(frame=f"{path}:{line} in {fn}",
                 waiting=calls_mpi or any(w in p for p, _, _ in main for w in WAITING + (WAITING_IF_IDLE if idle else ())),
                 caller=caller)
