"""The command line's output: a line printed at once, and what to do when its reader goes
away (`yarnapp status APP | head -1`, `yarnapp submit job.yaml --wait | head`)."""
import json
import math
import os
import select
import sys


def p(*a, **k):
    """print, flushed at once (the line is seen as it happens, through a pipe too)."""
    print(*a, **k, flush=True)


def as_json(obj, **kw):
    """JSON text of `obj` that strict parsers read: a non-finite number (a diverged loss's
    nan) is null, where json.dumps writes NaN, which JavaScript's and jq's parsers refuse."""
    def finite(o):
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: finite(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [finite(v) for v in o]
        return o
    return json.dumps(finite(obj), allow_nan=False, **kw)


def stdout_gone(stream=None):
    """The reader of stdout (or `stream`) went away: what this command would still print
    there goes nowhere, as after SIGPIPE, and so does the final flush's."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, (stream or sys.stdout).fileno())
    os.close(null)


def readers_gone():
    """After a BrokenPipeError: send whichever of stdout and stderr lost its reader (a pipe
    whose reader closed polls POLLERR) to /dev/null; return the stream still read, stdout
    first, or None."""
    alive = []
    for stream in (sys.stdout, sys.stderr):
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0)):
            stdout_gone(stream)
        else:
            alive.append(stream)
    return alive[0] if alive else None


def say(text, out):
    """Print a line on `out`; where its reader is gone, on the stream still read. Returns
    the stream to go on with."""
    try:
        p(text, file=out)
        return out
    except BrokenPipeError:
        out = readers_gone() or sys.stdout
        p(text, file=out)
        return out
