"""Process helpers the container side and the client share: a child that dies with the
process that started it, and a process's state as the kernel shows it."""
import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)     # loaded here: a dlopen in a forked child may deadlock


def die_with_parent():
    """preexec_fn: SIGKILL this child when its parent dies (no orphans)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def stopped(pid):
    """Whether a process is stopped (SIGSTOP, a frozen container: state T, or t when traced)."""
    return process_state(pid) in ("T", "t")


def process_state(pid):
    """The one-letter state of a process (R, S, D, T for stopped...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
