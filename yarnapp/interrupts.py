"""The client's signals: what stops an application submit(wait=True) waits for, and what
leaves it running.

- Ctrl-C, or SIGTERM in a script (`timeout`, a cancelled CI or Airflow task), while
  submit(wait=True) waits: the application is killed, then the script ends as the signal
  would end it. On the main thread SIGTERM becomes a KeyboardInterrupt during the wait
  (`sigterm_interrupts`); off it (a sweep's thread pool), the handler `install` puts on
  the main thread at import kills every application still waited for (`waited`), then
  ends the process with SIGTERM's default; Ctrl-C's (`_on_sigint`) kills those of the
  other threads, then raises KeyboardInterrupt as Python's own handler does. Where the
  program set its own handler, or in a notebook's kernel, nothing is installed.
- A notebook kernel shut down or restarted (Jupyter interrupts it first): left running
  (`kernel_shutting_down`).
- `shielded`: a kill that a second Ctrl-C cannot cut short.
- A CLI command stopped by SIGTERM as by Ctrl-C (`sigterm_stops_command`), ending 143 (130
  for Ctrl-C: `command_interrupted_status`).
"""
import contextlib
import os
import signal
import sys
import threading
import time

_WAITED = {}            # id(run) -> (Run, thread id): the applications submit(wait=True) waits for, in any thread
_BUSY = set()           # the threads inside submit(wait=True): starting an application, or waiting for it
_LOCK = threading.RLock()   # (re-entrant: the handler runs on the main thread, which may hold it)
_STATE = {"pid": None, "terminating": False, "pending": False, "refuse_until": 0.0}
# pid: where _on_sigterm was installed; terminating: SIGTERM under way (no application starts);
# pending: the process ends once the main thread's own submit(wait=True), interrupted as it
# started its application, has killed it
STOP_S = 30.0           # how long SIGTERM waits for the threads' applications to be killed
REFUSE_S = 2.0          # after Ctrl-C killed the threads' applications: the pool's next jobs start none


def _forked():
    """In a forked child (a Pool's worker): none of the parent's waits, threads or lock; a
    handler still installed is the child's own."""
    global _LOCK
    _LOCK = threading.RLock()
    _WAITED.clear()
    _BUSY.clear()
    _STATE.update(terminating=False, pending=False,
                  pid=os.getpid() if signal.getsignal(signal.SIGTERM) is _on_sigterm else None)


os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def submitting():
    """Around a submit(wait=True), from the start of its application to the end of its wait:
    once SIGTERM is being handled, none starts (a sweep's pool handed its thread the next
    job while the handler killed the others)."""
    me = threading.get_ident()
    with _LOCK:
        if _STATE["terminating"] or time.monotonic() < _STATE["refuse_until"]:
            raise KeyboardInterrupt("terminated: no application started")
        _BUSY.add(me)
    try:
        yield
    finally:
        with _LOCK:
            _BUSY.discard(me)
            pending = _STATE["pending"] and threading.current_thread() is threading.main_thread()
        if pending:
            terminate()


@contextlib.contextmanager
def waited(run):
    """While the block runs, SIGTERM kills `run`'s application (see install)."""
    with _LOCK:
        late = _STATE["terminating"]
        _WAITED[id(run)] = (run, threading.get_ident())
    try:
        if late:                    # started as SIGTERM came: its handler may have passed it by
            _kill(run)
        yield
    finally:
        with _LOCK:
            _WAITED.pop(id(run), None)


def kill_waited(others_only=False, word="terminated"):
    """Kill every application submit(wait=True) waits for in this process (but, `others_only`,
    any the calling thread waits for; a wait interrupted has left `waited` already), starting none
    meanwhile, until every other thread's wait has ended (at most STOP_S). Said on stderr
    ("<word>: killed APP"), written directly: a signal handler's print() may raise where the
    interrupted code was printing."""
    with _LOCK:
        _STATE["terminating"] = True
    me, killed, deadline = threading.get_ident(), set(), time.monotonic() + STOP_S
    while time.monotonic() < deadline:
        with _LOCK:
            runs = [r for r, tid in _WAITED.values()
                    if id(r) not in killed and not (others_only and tid == me)]
            others = _BUSY - {me}
        if not runs and not others:
            return
        for run in runs:
            killed.add(id(run))
            _kill(run, word)
        time.sleep(0.05)


def _kill(run, word="terminated"):
    """Kill `run`'s application as SIGTERM (or Ctrl-C) stops this process, saying so."""
    try:
        run.kill()
        _say(f"{word}: killed {run.app_id}")
    except Exception as e:  # noqa: BLE001 - the others, and the process's end, come first
        _say(f"{word}: could not kill {run.app_id}: {e}")


def _on_sigint(signum, frame):
    """Ctrl-C: KeyboardInterrupt, as Python's own handler raises it, once the applications
    submit(wait=True) waits for in other threads (a sweep's pool) are killed: they ran on,
    nothing watching them, and the pool's `with` waited for them to end (an audit: 34 s,
    then both SUCCEEDED). The main thread's own wait kills its own (its KeyboardInterrupt).
    The pool's next jobs start none for REFUSE_S; later submits start again."""
    me = threading.get_ident()
    with _LOCK:
        busy = bool(_BUSY - {me})
    if busy:
        try:
            kill_waited(others_only=True, word="interrupted")
        finally:
            with _LOCK:
                _STATE["terminating"] = False
                _STATE["refuse_until"] = time.monotonic() + REFUSE_S
    raise KeyboardInterrupt


def _say(line):
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def _on_sigterm(signum, frame):
    """SIGTERM's default action, once the applications submit(wait=True) waits for in other
    threads are killed (they ran on, nothing watching them, after `timeout` ended a sweep).
    Where it interrupted the main thread's own submit(wait=True) as it started its
    application, the process ends once that one is killed too (its wait comes next).
    Called by another handler that took SIGTERM over and calls the one before it (a
    training library's graceful stop), it kills what is waited for and returns: ending the
    process is that handler's to decide, and later submits start again."""
    chained = signal.getsignal(signal.SIGTERM) is not _on_sigterm
    if os.getpid() == _STATE["pid"]:
        kill_waited()
    with _LOCK:
        mine = threading.get_ident() in _BUSY
        if chained:
            _STATE["terminating"] = False
        elif mine:
            _STATE["pending"] = True
    if not chained and not mine:
        terminate()


def terminate():
    """End this process as SIGTERM's default action would (status 143 to a shell)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install():
    """Put _on_sigterm in SIGTERM's place where it has its default action, and _on_sigint in
    SIGINT's where it has Python's, on the main thread (signals are handled there), outside a
    notebook's kernel."""
    if threading.current_thread() is not threading.main_thread() or "ipykernel" in sys.modules:
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _STATE["pid"] = os.getpid()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


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


_COMMAND = {"terminated": False}    # a CLI command stopped by SIGTERM (sigterm_stops_command)


def command_started():
    """A CLI command begins: no SIGTERM has stopped it (one may have stopped an earlier
    command run in this process)."""
    _COMMAND["terminated"] = False


def sigterm_stops_command():
    """`kill` (SIGTERM) stops this command as cleanly as Ctrl-C: as a KeyboardInterrupt, so
    its `finally` blocks stop what it started (the default action would end it at once),
    and it ends with SIGTERM's status, 143 (`command_interrupted_status`)."""
    def interrupt(signum, frame):
        _COMMAND["terminated"] = True
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def command_terminated():
    """Whether SIGTERM stopped this command (not Ctrl-C)."""
    return _COMMAND["terminated"]


def command_interrupted_status():
    """The exit status of a command stopped by Ctrl-C (130) or by SIGTERM (143), as a shell gives."""
    return 143 if _COMMAND["terminated"] else 130
