"""`yarnapp logs`: container logs read as a user reads them, whole, their last lines, or
followed, from the files in pieces (logs a backend serves as text, YARN's, from the
text). A chatty rank's log grows without bound (1 MB/s is 86 GB a day): the whole file
was read into memory (a 200 MB log took 475 MB to print), and `--follow` read it all
again every half second."""
import contextlib
import os
import sys
import time

from .console import p as _p
from .errors import UsageError

CHUNK = 1 << 20             # bytes read at a time
BLOCK = 64 << 10            # bytes stepped back at a time looking for the last lines


def tail_offset(path, lines):
    """Where the last `lines` lines of the file start (a last line without its newline
    counts as one); 0 when it has no more."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if lines <= 0:
            return end
        f.seek(max(0, end - 1))
        seen = -1 if end and f.read(1) == b"\n" else 0     # the last newline ends the last line
        pos = end
        while pos > 0:
            step = min(BLOCK, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            i = len(block)
            while (i := block.rfind(b"\n", 0, i)) >= 0:
                seen += 1
                if seen == lines:
                    return pos + i + 1
        return 0


def tail_text(text, lines):
    """The last `lines` lines of a text (a log a backend serves as text, not as a file),
    lines ended by newlines only, as tail_offset counts them."""
    if lines is None:
        return text
    if lines <= 0 or not text:
        return ""
    parts = text.split("\n")
    if parts[-1] == "":
        parts.pop()
        return "\n".join(parts[-lines:]) + "\n"
    return "\n".join(parts[-lines:])


def read_from(path, offset=0, limit=None):
    """The file's text from `offset` (to `limit` bytes at most), as a text file reads
    (what does not decode replaced; \\r\\n and a lone \\r read as newlines)."""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read(limit if limit is not None else -1).decode(errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_logs(files, tail=None):
    """{container id: its log's text} of {container id: path} (`tail`: its last lines only,
    found from the file's end); a log not written yet is ""."""
    out = {}
    for name, path in files.items():
        try:
            out[name] = read_from(path, tail_offset(path, tail) if tail is not None else 0)
        except FileNotFoundError:
            out[name] = ""
    return out


def copy(path, out=None, offset=0):
    """Write the file from `offset` to `out` in pieces; returns whether it ended with a newline."""
    out = out or sys.stdout
    out.flush()
    last = b"\n"
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            out.buffer.write(chunk)
            last = chunk[-1:]
    out.buffer.flush()
    return last == b"\n"


class Follower:
    """New whole lines of growing files, from where each was left (`start`: {name: offset};
    a file not in it, a container started later, from its beginning). A file that shrank,
    or another file now at its path, is read again from its start. A line redrawn in place
    (a progress bar's \\r) is its last drawing, as a terminal shows it."""

    LONGEST = CHUNK         # a line longer than this (no newline: binary, \r-drawn bars) is cut

    def __init__(self, start=None):
        self.offsets = dict(start or {})
        self.partial = {}
        self.inodes = {}

    def lines(self, files):
        """(name, line) of the lines completed since the last call, a chunk at a time."""
        for name, path in files.items():
            try:
                f = open(path, "rb")
            except OSError:             # not there yet, or gone (its application cleaned)
                continue
            with f:
                st = os.fstat(f.fileno())
                off = self.offsets.get(name, 0)
                if st.st_size < off or self.inodes.setdefault(name, st.st_ino) != st.st_ino:
                    off, self.partial[name], self.inodes[name] = 0, b"", st.st_ino
                f.seek(off)
                while off < st.st_size:
                    chunk = f.read(min(CHUNK, st.st_size - off))
                    if not chunk:
                        break
                    off += len(chunk)
                    *whole, rest = (self.partial.get(name, b"") + chunk).split(b"\n")
                    if len(rest) > self.LONGEST:
                        whole, rest = whole + [rest], b""
                    self.partial[name] = rest
                    self.offsets[name] = off
                    for line in whole:
                        yield name, _drawn(line)

    def rest(self):
        """(name, line) of the last lines that never got their newline."""
        out = [(name, _drawn(rest)) for name, rest in self.partial.items() if rest]
        self.partial = {}
        return out


def _drawn(line):
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode(errors="replace")


def cmd_logs(args):
    if args.tail is not None and args.tail < 0:
        raise UsageError(f"--tail {args.tail}: give a number of lines, 0 or more")
    from . import api
    run = api.Run(args.app)
    files = run.log_files(args.container)       # None: logs served as text (YARN)
    if not args.follow:
        if files is None:
            texts = run.logs(args.container, tail=args.tail)
        for cid in (files if files is not None else texts):
            _p(f"==> {cid} <==")
            if files is None:
                _p(texts[cid], end="" if texts[cid].endswith("\n") else "\n")
                continue
            try:                                # read in pieces: a log can be larger than memory
                start = tail_offset(files[cid], args.tail) if args.tail is not None else 0
                whole = copy(files[cid], sys.stdout, start)
            except FileNotFoundError:
                whole = True
            if not whole:
                _p()
        return 0
    if files is not None:
        return _follow_files(run, args)
    printed = {}
    if args.tail is not None:                   # all but the last lines taken as printed
        printed = {cid: text[:len(text) - len(tail_text(text, args.tail))]
                   for cid, text in run.logs(args.container).items()}
    while True:
        ended = run.state in ("SUCCEEDED", "FAILED", "KILLED")   # before the read: no last line is lost
        for cid, text in run.logs(args.container).items():
            new = follow_increment(printed.get(cid, ""), text)
            for line in new.splitlines():
                _p(f"{cid}| {line}")
            printed[cid] = text
        if ended:
            return _followed_to_the_end(run, args)
        time.sleep(0.5)


def _follow_files(run, args):
    """--follow of logs that are files here: each read on from where it was left."""
    start = {}
    if args.tail is not None:
        for cid, path in run.log_files(args.container).items():
            with contextlib.suppress(FileNotFoundError):
                start[cid] = tail_offset(path, args.tail)
    follower = Follower(start)
    while True:
        ended = run.state in ("SUCCEEDED", "FAILED", "KILLED")   # before the read: no last line is lost
        for cid, line in follower.lines(run.log_files(args.container)):
            _p(f"{cid}| {line}")
        if ended:
            for cid, line in follower.rest():
                _p(f"{cid}| {line}")
            return _followed_to_the_end(run, args)
        time.sleep(0.5)


def _followed_to_the_end(run, args):
    """How it ended, as submit --wait says it (the logs alone do not), and its status."""
    from .cli_job import submitted_as
    state = run.state
    _p(run.failure_message(resubmit=submitted_as(run.status())) or f"{args.app} {state}", file=sys.stderr)
    return 0 if state == "SUCCEEDED" else 1


def follow_increment(printed, text):
    """What of `text` is new after `printed` was shown: the rest when it continues it; all of
    it when it replaced it (a placeholder replaced by the real log, which used to lose as
    many characters as the placeholder had)."""
    return text[len(printed):] if text.startswith(printed) else text
