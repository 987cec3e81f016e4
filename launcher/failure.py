"""One failure record: why a generation of the world ended, or why the application failed.

Agents (launcher.agent) and the local engine's master (yarnapp.backends.local.am) write
it to the store: `keys.abort(gen)` (first writer wins: the root cause of that generation; for a world that
did not form, the record naming containers that never reported: launcher.diagnosis.says_more),
`keys.restart(gen)` (the generation that follows it, with the cause), `keys.FAILED` (the
application's end); a rank writes its own error line the same way (`keys.error(gen, rank)`:
`error` and `phase`, read by the agents to tell a deterministic failure). Status (both
engines), results and the YARN backend read every one back through this type
(`Failure.load`, or `Failure.record` for the plain dict they show). On the wire it is a
JSON object; readers ignore fields they do not know. Below it, what both the agents and
the master read from those records: the generation now, the restarts spent, and whether
an error line reads like a lost peer's.
"""
import dataclasses
import enum
import json
import re
import time
from typing import Optional

from . import keys


class Kind(str, enum.Enum):
    CRASHED = "crashed"              # the rank process exited non-zero or died of a signal
    OOM = "oom"                      # ... killed by the kernel for its container's memory
    HUNG = "hung"                    # no heartbeat within the limit (a stopped process included)
    NOT_FORMED = "world-not-formed"  # the world did not form within launcher.rendezvous_timeout
    LOST = "lost-container"          # a member's container exited or was replaced
    CONTAINER = "container"          # the container itself (not its rank) died
    EXTERNAL = "external"            # stopped by the resource manager, or the master died:
                                     # not the job's fault, spends no restart
    SETUP = "setup"                  # the application could not be set up (emulated network...)


@dataclasses.dataclass
class Failure:
    reason: str                              # one line for people
    kind: str = Kind.CRASHED.value
    container: Optional[str] = None          # whose failure it is
    rank: Optional[int] = None
    exit_code: Optional[int] = None
    error: Optional[str] = None              # the rank's own error line (launcher.rank)
    phase: Optional[str] = None              # setup | train, when the rank said
    external: bool = False                   # spends no restart (see spent_restarts)
    observed_by: Optional[str] = None        # the container whose agent saw it, if not its own
    generation: Optional[int] = None
    time: Optional[float] = None
    log: str = ""
    log_tail: str = ""
    input_error: Optional[bool] = None       # the rank's line is the whole story (a job's mistake it
                                             # found: a YarnappError), so `submit --wait` shows no log tail
    repeats: Optional[bool] = None           # that mistake is in the data's content (a bad page) or a
                                             # checkpoint's storage (full, read-only): a restart meets
                                             # it again (launcher.retries)
    certain: Optional[object] = None         # a mistake every attempt meets (launcher.retries): True for the
                                             # job's model or strategy settings, else its words (a dataset
                                             # changed under the job)
    attempts: Optional[int] = None           # on FAILED: how many generations ran
    retried: Optional[bool] = None           # on FAILED: False when not retried (deterministic)
    aborted_generation: Optional[int] = None  # on a restart record: the generation that ended
    blames: Optional[int] = None             # on a rank's error line that every rank raised alike (a
                                             # checkpoint part one rank could not write): the rank at fault

    def stamped(self, **fields):
        """A copy with `fields` set, and the time now if it had none."""
        out = dataclasses.replace(self, **fields)
        if out.time is None:
            out.time = time.time()
        return out

    def as_dict(self):
        """The wire form: every field that is set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def dumps(self):
        return json.dumps(self.as_dict())

    @classmethod
    def _given(cls, raw):
        """The known fields set in `raw` (bytes, str or a dict), or None when there is none."""
        if raw is None:
            return None
        d = json.loads(raw) if isinstance(raw, (bytes, str)) else dict(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in d.items() if k in names} if d else None

    @classmethod
    def load(cls, raw):
        """The record in `raw` (bytes, str or a dict), or None when there is none."""
        given = cls._given(raw)
        return cls(**{"reason": "", **given}) if given is not None else None

    @classmethod
    def record(cls, raw):
        """The record in `raw` as the plain dict status and results show (the fields it
        sets, and reason), or None."""
        given = cls._given(raw)
        if given is None:
            return None
        return {k: v for k, v in cls.load(given).as_dict().items() if k in given or k == "reason"}


# What a rank's error line says when it only lost a peer (MPI, gloo, NCCL, sockets).
_COLLATERAL = re.compile(r"MPI|gloo|NCCL|[Cc]onnection (closed|reset|refused)|[Bb]roken pipe|peer")


# What a rank's error line says when its container has no CUDA device for its code: a GPU
# script on a container without GPUs, or past the ones it has (every attempt meets it).
_NO_DEVICE = re.compile(r"Found no NVIDIA driver|Torch not compiled with CUDA|No CUDA GPUs are available|"
                        r"invalid device ordinal|ProcessGroupNCCL is only supported with GPUs|"
                        r"CUDA driver version is insufficient")


def lacks_a_device(line):
    """Whether a rank's error line says its container has no CUDA device for its code."""
    return bool(line) and bool(_NO_DEVICE.search(line))


# A filesystem out of reach for now (a NameNode or DataNode restarting, HDFS in safe mode,
# a server's 503): a restart a little later may find it back (launcher.retries, the agent's
# backoff). An audit's 10-20 s NameNode outage spent every restart within 3 s.
_UNREACHABLE = re.compile(r"connection refused|failed to establish a new connection|safe ?mode|read timed out|"
                          r"503 server error|service unavailable|no route to host|retriableexception|"
                          r"standbyexception", re.IGNORECASE)
# ... said of HDFS or of the job's checkpoints (not a peer's socket, a tracking server's URL,
# a host named datanode3), and not a name that will never resolve
_STORAGE = re.compile(r"\b(?:web)?hdfs://|viewfs://|checkpoint\.uri|name ?node is", re.IGNORECASE)
_NEVER = re.compile(r"name or service not known|nodename nor servname|permission denied|access denied",
                    re.IGNORECASE)


def storage_unreachable(line):
    """Whether a rank's error line says HDFS or the checkpoints' filesystem could not be
    reached (for now, maybe): not a peer's socket (gloo's "Connection refused" of a rank
    that left), nor a host name that does not resolve, nor a permission."""
    return bool(line) and bool(_UNREACHABLE.search(line)) and bool(_STORAGE.search(line)) and \
        not _NEVER.search(line)


def looks_collateral(line):
    """Whether a rank's error line reads like a lost peer's consequence, not its own fault."""
    return bool(_COLLATERAL.search(line))


def current_generation(store):
    """The world's generation now: the first without an abort record."""
    aborted = {k.split("/")[1] for k in store.get_prefix(keys.ABORT_PREFIX) if k.endswith("/abort")}
    gen = 0
    while f"{gen:04d}" in aborted:
        gen += 1
    return gen


def spent_restarts(store, upto):
    """Aborted generations 0..upto that count against max_restarts: all but those whose
    container the resource manager stopped (preemption, node decommission...)."""
    n = 0
    for g in range(upto + 1):
        f = Failure.load(store.get(keys.abort(g)))
        if f is not None and not f.external:
            n += 1
    return n


def spends_the_last_restart(store, gen, max_restarts):
    """Whether an abort of generation `gen` that counts (not external) would leave no restart,
    so that the application fails: asked before that abort is written."""
    return spent_restarts(store, gen - 1) + 1 > max_restarts


def log_tail(path, lines=20):
    """The last `lines` lines of a container's log, for a Failure's log_tail: "" if
    unreadable; from the last of the engine's "==== NAME attempt N started" lines on, and ""
    where nothing follows it (a rank killed for memory before it wrote a line: the excerpt
    showed that header alone); the agent's state changes left out."""
    tail = read_tail(path, size=8192).splitlines()
    heads = [i for i, line in enumerate(tail) if line.startswith("==== ")]
    tail = tail[heads[-1] + 1:] if heads else tail        # this attempt's lines (every attempt appends)
    tail = [line for line in tail if not _TRANSITION.search(line) and not line.startswith(CRASH_BOILERPLATE)][-lines:]
    return "\n".join(tail) if any(line.strip() for line in tail) else ""


def native_crash(path, offset=0):
    """What a rank that died of a signal said natively in its log after `offset` (where its
    generation started), as one line, or "": a C++ exception nothing caught ("terminate
    called after throwing an instance of 'gloo::EnforceNotMet'" and its what(), SIGABRT: a
    collective that ranks called with different sizes), else the interpreter's "Fatal
    Python error"; and where the main thread was (the dump of launcher.stacks.enable).
    Python's stderr never sees these, so the failure read "killed by signal 6" alone."""
    from .stacks import where
    text = read_tail(path, offset)
    thrown = [m for m in _THROWN.finditer(text)][-1:]
    fatal = [m for m in _FATAL.finditer(text)][-1:]
    said = ""
    if thrown:
        what = _ENFORCE_AT.sub("", (thrown[0].group("what") or "").strip())
        said = f"a C++ exception nothing caught, {thrown[0].group('type')}" + (f": {what}" if what else "")
    elif fatal:
        said = f"Fatal Python error: {fatal[0].group(1).strip()}"
    at = where(text[fatal[0].end():]) if fatal else None
    return f"{said} (at {_DIRS.sub('', at.describe())})" if said and at else said


def read_tail(path, offset=0, size=65536):
    """A log's last `size` bytes after `offset` (where a rank's generation started) as text,
    or "" where it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(offset, f.tell() - size))
            return f.read().decode(errors="replace")
    except (OSError, TypeError):
        return ""


ERROR_LINE_CHARS = 600      # of a rank's error line in the store (status, restarts, the failure)
FAILED_LOGGER = "launcher.rank.failed"      # the logger of the line a rank's fail() ends with


def cut(line):
    """A rank's error line at most ERROR_LINE_CHARS long: its start (what) and its end (what
    to do; a cut mid-word lost the advice)."""
    return f"{line[:ERROR_LINE_CHARS - 203]} [...] {line[-196:]}" if len(line) > ERROR_LINE_CHARS else line


def logged_error(path, offset=0):
    """The line a rank's fail() logged after `offset` (FAILED_LOGGER: its error line, which
    also goes to the store; where the store could not take it, a disk full or no file
    descriptor left, this is where it is), or "". Not any line of ours: a rank that exits
    1 otherwise is described by its own last line."""
    found = _FAILED_LINE.findall(read_tail(path, offset))
    return cut(found[-1].strip()) if found else ""


_FAILED_LINE = re.compile(r"^\S+ \S+ rank\d+ \S+ " + re.escape(FAILED_LOGGER) + r": ([^\n]+)", re.M)
_THROWN = re.compile(r"^terminate called after throwing an instance of '(?P<type>[^']+)'\n"
                     r"(?:\s*what\(\):\s*(?P<what>[^\n]*))?", re.M)
_FATAL = re.compile(r"^Fatal Python error: ([^\n]+)", re.M)
_ENFORCE_AT = re.compile(r"^\[enforce fail at [^\]]*\]\s*")      # gloo's own source line
_DIRS = re.compile(r"(?<![\w.])/(?:[^/\s:()]+/)+")      # a frame's file by its name (its log has the path)


CRASH_BOILERPLATE = "Extension modules: "     # a crash dump's list of every module loaded (native_crash)
# the agent's own state changes ("RUNNING -> RESTARTING (generation 0)"): an excerpt of a
# failure not retried ended in "RESTARTING", which read as a restart
_TRANSITION = re.compile(r" agent \S+ INFO: [A-Z_]+ -> [A-Z_]+ \(generation \d+\)$")


EXITED_EARLY = "had ended (exit 0)"     # said of a rank whose code ended first (ended_early, launcher.retries)
WAITED_FOR_FINISHED = "whose code had finished"     # said of the ranks a peer waited for in a collective
CALLED_APART = "different collectives of training.dist"     # said of ranks whose calls never meet (diagnosis)


def caused_by_an_end(failure):
    """Whether a generation's abort reads as the consequence of a rank's code ending while
    its peers still ran collectives (a peer waited for finished ranks, or lost its
    connection to them): the finished rank then leaves with 0, as the rank that ended
    early, and is not retried; else (a peer's own failure) it leaves as one of the aborted
    world's, and the restart is owed."""
    return failure is not None and (WAITED_FOR_FINISHED in (failure.reason or "")
                                    or looks_collateral(failure.error or failure.reason or ""))


def ended_in(store, members, gen, wait_s=0.0):
    """Those of `members` ("rank 1 (w_1)") whose code ended (exit 0) in generation `gen`.
    Waits up to wait_s for one: a peer's agent records its end as the others record the
    failure its end caused."""
    deadline = time.monotonic() + wait_s
    while True:
        out = []
        for m in members:
            raw = store.get(keys.done(m["container"]))
            if raw is not None and json.loads(raw).get("generation") == gen:
                out.append(f"rank {m['rank']} ({m['container']})")
        if out or time.monotonic() >= deadline:
            return out
        time.sleep(min(0.05, wait_s))


_SOURCE_AT = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\]\s*")     # gloo's "[/__w/.../pair.cc:537] "
_ADVICE = re.compile(r" This is typically caused by[^()]*?(?= \(|$)")  # gloo's advice, to the code's "(at ...)"


def after_an_end(early, reason):
    """The reason of a generation a rank's early end broke: the rank that ended first (`early`,
    ended_early's note), then the peer's failure it caused, without gloo's source path and
    advice (its line led, and read as the peer's own crash)."""
    brief = _ADVICE.sub("", _SOURCE_AT.sub("", reason))
    return f"{early} (then {brief})"


def ended_early(store, members, gen, rank, wait_s=0.0):
    """The note naming the peers of `rank` whose code ended (exit 0) in generation `gen`
    while the others still ran, or None: a rank that leaves training early (a `sys.exit(0)`
    at step 3) breaks its peers' collectives, and the peer whose collective failed (gloo's
    "Connection reset by peer") was named alone. Waits up to wait_s for a peer's agent to
    record its end, which it does as this one records the failure."""
    early = ended_in(store, [m for m in members if m["rank"] != rank], gen, wait_s)
    if not early:
        return None
    return (f"{', '.join(early)} {EXITED_EARLY} while the others still ran collectives with "
            f"{'it' if len(early) == 1 else 'them'}: every rank must run the same steps")
