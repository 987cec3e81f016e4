"""The client's signals: what stops an application submit(wait=True) waits for, and what
leaves it running.

- Ctrl-C, or SIGTERM in a script (`timeout`, a cancelled CI or Airflow task), while
  submit(wait=True) waits: the application is killed, then the script ends as the signal
  would end it. On the main thread SIGTERM becomes a KeyboardInterrupt during the wait
  (`sigterm_interrupts`); off it (a sweep's thread pool), the handler `install` puts on
  the main thread at import kills every application still waited for (`waited`), then
  ends the process with SIGTERM's default. Where the program set its own SIGTERM handler,
  or in a notebook's kernel, nothing is installed.
- A notebook kernel shut down or restarted (Jupyter interrupts it first): left running
  (`kernel_shutting_down`).
- `shielded`: a kill that a second Ctrl-C cannot cut short.
"""
import contextlib
import os
import signal
import sys
import threading
import time

_WAITED = {}            # id(run) -> Run: the applications submit(wait=True) waits for, in any thread
_LOCK = threading.Lock()
_INSTALLED_IN = [None]  # the pid that installed _on_sigterm


@contextlib.contextmanager
def waited(run):
    """While the block runs, SIGTERM kills `run`'s application (see install)."""
    with _LOCK:
        _WAITED[id(run)] = run
    try:
        yield
    finally:
        with _LOCK:
            _WAITED.pop(id(run), None)


def _on_sigterm(signum, frame):
    """SIGTERM's default action, once the applications submit(wait=True) waits for in other
    threads are killed (they ran on, nothing watching them, after `timeout` ended a sweep)."""
    with _LOCK:     # (a forked child, a Pool's worker that Pool.terminate() stops, kills nothing of its parent's)
        runs = list(_WAITED.values()) if os.getpid() == _INSTALLED_IN[0] else []
    for run in runs:
        try:
            run.kill()
            print(f"terminated: killed {run.app_id}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - the others, and the process's end, come first
            print(f"terminated: could not kill {run.app_id}: {e}", file=sys.stderr, flush=True)
    terminate()


def terminate():
    """End this process as SIGTERM's default action would (status 143 to a shell)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install():
    """Put _on_sigterm in SIGTERM's place where it has its default action, on the main
    thread (signals are handled there), outside a notebook's kernel."""
    if threading.current_thread() is threading.main_thread() and "ipykernel" not in sys.modules \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _INSTALLED_IN[0] = os.getpid()


def shielded(fn):
    """fn() with Ctrl-C and SIGTERM held off once: a second Ctrl-C cut a kill short, and its
    line with it; a third still interrupts (a kill stuck on a cluster out of reach can be
    left). The handlers are restored after. Off the main thread, fn() as it is."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    seen = []

    def hold(signum, frame):
        seen.append(signum)
        if len(seen) > 1:
            raise KeyboardInterrupt
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in before:
        signal.signal(sig, hold)
    try:
        return fn()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


KERNEL_SHUTDOWN_GRACE_S = 1.0   # Jupyter sends a shutdown request right after its interrupt


def kernel_shutting_down():
    """Whether the interrupt that reached a notebook's kernel is the one Jupyter sends before
    it shuts the kernel down or restarts it (jupyter_client interrupts a busy kernel first):
    the kernel's shutdown request, handled on its control thread, sets the shell's
    `exit_now` within moments. A user's interrupt is not followed by one. A second interrupt
    meanwhile is the user's."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
        shell = get_ipython()
        deadline = time.monotonic() + KERNEL_SHUTDOWN_GRACE_S
        while shell is not None and not getattr(shell, "exit_now", False) and time.monotonic() < deadline:
            time.sleep(0.02)
        return shell is not None and bool(getattr(shell, "exit_now", False))
    except (ImportError, KeyboardInterrupt):
        return False


def sigterm_interrupts(terminated):
    """While a script waits in submit(wait=True), SIGTERM (`timeout`, a cancelled CI job) stops
    it as Ctrl-C does, so that the application is killed with it (it ran on, every process of
    it). Not where the script set its own handler, off the main thread, or in a notebook's
    kernel (restarted or shut down, it leaves the application running, as documented).
    Returns what restores the handler."""
    before = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or "ipykernel" in sys.modules or \
            before not in (signal.SIG_DFL, _on_sigterm):
        return lambda: None

    def interrupt(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, before)
