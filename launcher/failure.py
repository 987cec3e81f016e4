"""One failure record: why a generation of the world ended, or why the application failed.

Agents (launcher.agent) and the local engine's master (yarnapp.backends.local.am) write
it to the store: `keys.abort(gen)` (first writer wins: the root cause of that generation),
`keys.restart(gen)` (the generation that follows it, with the cause), `keys.FAILED` (the
application's end); a rank writes its own error line the same way (`keys.error(gen, rank)`:
`error` and `phase`, read by the agents to tell a deterministic failure). Status (both
engines), results and the YARN backend read every one back through this type
(`Failure.load`, or `Failure.record` for the plain dict they show). On the wire it is a
JSON object; readers ignore fields they do not know.
"""
import dataclasses
import enum
import json
import time
from typing import Optional


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
    attempts: Optional[int] = None           # on FAILED: how many generations ran
    retried: Optional[bool] = None           # on FAILED: False when not retried (deterministic)
    aborted_generation: Optional[int] = None  # on a restart record: the generation that ended

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
