"""Process helpers the container side and the client share: a child that dies with the
process that started it, and a process's state and use as the kernel shows them."""
import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)     # loaded here: a dlopen in a forked child may deadlock


def die_with_parent():
    """preexec_fn: SIGKILL this child when its parent dies (no orphans)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_exit(pids, timeout, fds=()):
    """Sleep up to `timeout` seconds, or until one of `pids` ends (a pidfd becomes readable
    then: a loop that polls its children reacts at once, and can look less often), or one
    of `fds` (a pipe a process answers on) has something to read."""
    import os
    import select
    import time
    opened = []
    try:
        for pid in pids:
            try:
                opened.append(os.pidfd_open(pid))
            except ProcessLookupError:
                return                              # already ended
            except OSError:                         # no pidfd (an old kernel): a plain sleep
                time.sleep(timeout)
                return
        if not opened and not fds:
            time.sleep(timeout)
            return
        poller = select.poll()          # (select.select refuses fds past 1023)
        for fd in (*opened, *fds):
            poller.register(fd, select.POLLIN)
        poller.poll(timeout * 1000)
    finally:
        for fd in opened:
            os.close(fd)


def stopped(pid):
    """Whether a process is stopped (SIGSTOP, a frozen container: state T, or t when traced)."""
    return process_state(pid) in ("T", "t")


def _stat(pid):
    """The fields of /proc/PID/stat after the command's name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid):
    """The one-letter state of a process (R, S, D, T for stopped...), or None."""
    fields = _stat(pid)
    return fields[0] if fields else None


def parent_pid(pid):
    """A process's parent's pid, or None where it is gone."""
    fields = _stat(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def cpu_seconds(pid):
    """CPU seconds a process and its descendants have used (the live ones, and those it has
    reaped), or None where it is gone: a rank's own and its DataLoader workers'."""
    import psutil
    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in p.children(recursive=True):
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return None


def resident_bytes(pid):
    """Resident memory of a process and its live descendants (what YARN's NodeManager adds
    up for its memory check), or None where it is gone."""
    import psutil
    try:
        p = psutil.Process(pid)
        total = p.memory_info().rss
        for child in p.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return None
