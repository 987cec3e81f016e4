"""CPU seconds of this process by kind of work, counted where the work is done.

The strategies and the collectives mark their work: `with cputime.counting("wait"):`.
Whoever wants to know where a step's CPU went (the planner's strategy probe,
benchmarks/planner_check.py) turns counting on, resets, runs a step and reads
`seconds()`; nobody needs to wrap anybody's functions. Regions nest, and a region's
time goes to the innermost one running: a gradient hook inside the model's backward
counts as "hooks", not "model"; the waits inside a conv-MP layer's protocol count as
"wait". Only the thread that turned counting on counts (time.process_time is the
whole process's, so another thread's regions could not be told apart). Off, a region
is one shared do-nothing context manager.

Kinds:
    model      forward + backward of the model on this rank's rows (data parallel)
    share      a conv-MP rank's share of a distributed conv, forward and backward
    optimizer  optimizer.step()
    wait       completing MPI requests (training.collectives.wait)
    hooks      gradient hooks (bucket copies, progressing reductions)
    protocol   the conv-MP protocol: distributed layers' forward, their communication's
               backward, the master's commands, gathering conv times
"""
import functools
import threading
import time

KINDS = ("model", "share", "optimizer", "wait", "hooks", "protocol")

_owner = None                        # the thread that counts (None: counting is off)
_seconds = dict.fromkeys(KINDS, 0.0)
_stack = []                          # [kind, CPU time it last resumed] of the open regions


class _Region:
    __slots__ = ("kind",)

    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        now = time.process_time()
        if _stack:
            outer = _stack[-1]
            _seconds[outer[0]] += now - outer[1]
        _stack.append([self.kind, now])

    def __exit__(self, *exc):
        now = time.process_time()
        kind, since = _stack.pop()
        _seconds[kind] += now - since
        if _stack:
            _stack[-1][1] = now


class _Off:
    __slots__ = ()

    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


_OFF = _Off()


def counting(kind):
    """A context manager adding the CPU time of its block to `kind` (while counting is on)."""
    if _owner is not None and _owner == threading.get_ident():
        return _Region(kind)
    return _OFF


def counted(kind):
    """A decorator: the function's CPU time counts as `kind` (as `with counting(kind):`
    around its body); for torch.autograd.Function's forward and backward under their
    @staticmethod."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with counting(kind):
                return fn(*args, **kwargs)
        return inner
    return wrap


def enable(flag=True):
    """Count (in this thread) from now on, or stop counting; the totals start at zero."""
    global _owner
    _owner = threading.get_ident() if flag else None
    _stack.clear()
    reset()


def reset():
    for k in _seconds:
        _seconds[k] = 0.0


def seconds():
    """{kind: CPU seconds} counted since the last reset()."""
    return dict(_seconds)
