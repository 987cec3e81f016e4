"""Ctrl-C and SIGTERM held back while a process is started and recorded.

Inside subprocess.Popen an interrupt loses the process it has just started (Popen raises
before returning it), so whoever started it can no longer stop it; between starting a
process and writing down its pid, the same. `deferred()` makes such a step whole: the
interrupt is handled when it ends, by the handler it would have met, and the caller's
`except`/`finally` then sees every process it started.
"""
import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def deferred():
    """SIGINT and SIGTERM arriving inside are handled on leaving it. The kernel's signal
    mask is left alone (children would inherit it). An ignored signal stays ignored (and
    so inherited as ignored), a handler installed outside Python (getsignal: None) stays in
    place, and outside the main thread, where Python runs no handler, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    held = [s for s in SIGNALS if callable(signal.getsignal(s)) or signal.getsignal(s) == signal.SIG_DFL]
    old = {s: signal.signal(s, lambda signum, frame: got.append((signum, frame))) for s in held}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for signum, frame in got:
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)
