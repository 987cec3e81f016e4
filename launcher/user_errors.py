"""How an error from the job's code reads: its one line (`Type: message (train.py:12 in step)`,
or where a non-zero sys.exit happened and the last line the code wrote to stderr), and its
traceback without yarnapp's frames above the user's. launcher.rank writes the line to the store;
the agent reports it.
"""
import functools
import os
import re
import traceback

from conf.schema import PACKAGES

RANK_FILES = (*(os.path.join(os.path.dirname(__file__), f) for f in ("rank.py", "user_code.py")),   # frames above
              __file__)                                                                                # the job's


class LastLine:
    """A stream wrapper that remembers the last non-empty line written through it."""

    def __init__(self, stream):
        self._stream = stream
        self.last = ""

    def write(self, text):
        lines = [ln for ln in str(text).splitlines() if ln.strip()]
        if lines:
            self.last = lines[-1].strip()
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def print_user_traceback(exc):
    """The traceback of an exception from the job's code, without launcher.rank's and runpy's
    frames above it (the user's own frames are what they need)."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (*RANK_FILES, "<frozen runpy>")
                              or tb.tb_frame.f_code.co_filename.endswith("runpy.py")):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


ERROR_CHARS = 300      # of an exception's message in its one line


def exit_line(exc, last):
    """The line of a SystemExit with a non-zero status: sys.exit("message")'s message; else
    where the job's code exited (`sys.exit(3) at train.py:37 in main`, an argparse error at its
    parse_args call) and the last line it wrote to stderr, which may be its reason (argparse's
    `error: ...`) or may not (a greeting at its start): before, that line alone was the reason."""
    if isinstance(exc.code, str):
        return exc.code
    own = [f for f in traceback.extract_tb(exc.__traceback__) if _users(f.filename)]
    at = f"sys.exit({exc.code}) at {_place(own[-1])}" if own else ""
    if at and last:
        return f"{at}; its last line on stderr: {last}"
    return at or last or f"exited with status {exc.code}"


def _place(frame):
    """`train.py:12 in step` (a function shipped by value has lost its file's name, cloudpickle's
    <dynamic-code>: `line 12 in step`)."""
    where = "line " if frame.filename.startswith("<") else os.path.basename(frame.filename) + ":"
    return f"{where}{frame.lineno} in {frame.name}"


def error_line(exc):
    """The one line of an exception from the job's code: `Type: message`, the message's lines
    joined, and where the job's code raised it (`(train.py:12 in step)`: an `assert x == 4`
    said only "AssertionError: ", a message of several lines kept only its first)."""
    text, place = str(exc), None
    wrapped = WRAPPED.match(text)
    if wrapped:     # torch's ExceptionWrapper (a DataLoader worker's): the cause and its place, last
        head, tb = wrapped.group(1), wrapped.group(2).strip().splitlines()
        text = f"{head.rstrip('.')}: {tb[-1].strip()}" if tb else head
        frames = [(f, int(n), fn) for f, n, fn in TB_FRAME.findall(wrapped.group(2)) if _users(f)]
        place = _place(traceback.FrameSummary(*frames[-1], lookup_line=False)) if frames else None
    message = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if len(message) > ERROR_CHARS:          # a state_dict's "Error(s) in loading" runs to pages
        message = message[:ERROR_CHARS - 3] + "..."
    line = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    own = [f for f in traceback.extract_tb(exc.__traceback__) if _users(f.filename)]
    if place is None and not own:
        return line
    return f"{line} ({place or _place(own[-1])})"


WRAPPED = re.compile(r"(Caught \w+ in .*?)\s*\nOriginal Traceback \(most recent call last\):\n(.*)", re.S)
TB_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.M)


@functools.cache
def _users(filename):
    """Whether a frame's file is the job's code: not yarnapp's, nor the environment's (the
    standard library, site-packages)."""
    import sysconfig
    if filename.startswith("<frozen") or filename in RANK_FILES:
        return False
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    theirs = [os.path.join(ours, p, "") for p in PACKAGES]
    theirs += [os.path.join(os.path.realpath(p), "") for p in {sysconfig.get_paths()[k] for k in
                                                              ("stdlib", "platstdlib", "purelib", "platlib")}]
    path = os.path.realpath(filename) if os.path.isabs(filename) else filename
    return not any(path.startswith(t) for t in theirs)


def function_kind(fn):
    """"async def", "async generator" or "generator" for a function whose call runs none of
    its body, else None."""
    import inspect
    return next((k for k, test in (("async def", inspect.iscoroutinefunction),
                                   ("async generator", inspect.isasyncgenfunction),
                                   ("generator", inspect.isgeneratorfunction)) if test(fn)), None)


def never_ran(name, kind):
    """The line for a function whose call runs none of its body (`kind`: "async def",
    "generator", "async generator"): every rank "succeeded" at once."""
    made = {"async def": "coroutine"}.get(kind, kind)
    return (f"{kind} {name}: every rank calls {name}(ctx), which only makes a {made} nobody runs; make it a "
            f"plain def (asyncio.run(...) inside it)")
