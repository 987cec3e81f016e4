"""The cluster-backend seam: one interface, implementations registered by name."""
import abc

from ..errors import YarnappError


class Backend(abc.ABC):
    """Starts, observes and stops applications. Returned records are plain dicts:

    status(app_id) -> {"app_id", "name", "state": NEW|RUNNING|SUCCEEDED|FAILED|KILLED,
                       "containers": [{"id", "group", "instance", "state", "exit_code",
                                        "exit": what a non-zero status means (launcher.exitcodes),
                                        "attempts", "log"}], "final": {...} | None,
                       "restarts": [{"generation", "reason"}], "diagnostics": str,
                       "progress": {rank: {...}}, "tensorboard": url | None,
                       "world_formed_s": float | None,
                       "notices": [{"text", "ranks", "generation", "time"}] (launcher.results.notices)}
    """

    name = "base"

    @abc.abstractmethod
    def submit(self, job, where="job", setting=()):
        """Start the application for a validated conf.JobSpec; return its app id (`where`:
        its source, for errors; `setting`: the arguments that set its fields, yarnapp.api.start)."""

    @abc.abstractmethod
    def status(self, app_id):
        ...

    @abc.abstractmethod
    def logs(self, app_id, container=None):
        """{container_id: log text} (one container when given)."""

    def log_files(self, app_id, container=None):
        """{container_id: the path of its log here} (one container when given), or None where
        this backend serves logs as text only (YARN's NodeManagers and aggregated logs)."""
        return None

    @abc.abstractmethod
    def kill(self, app_id):
        ...

    @abc.abstractmethod
    def list(self):
        """[status-like dicts] of known applications, newest first."""

    def job_of(self, app_id):
        """The conf.JobSpec application `app_id` was submitted with, or None where this
        backend does not keep it."""
        return None

    def checkpoints_of(self, app_id, job):
        """Where application `app_id` of `job` writes its checkpoints (a URI or a local
        path; training.checkpoint's layout), or None where this backend cannot say."""
        from launcher.identity import checkpoint_dir
        return checkpoint_dir(app_id, job.checkpoint.uri) if job.checkpoint.uri else None


TERMINAL = ("SUCCEEDED", "FAILED", "KILLED")


def check_resumed_ended(app, state, where, latest=False):
    """checkpoint.resume naming an application still running (`state`), refused before
    anything starts: while it trains it writes new checkpoints and removes its oldest
    (checkpoint.keep), and the ranks that read them failed on a file gone, saying the
    checkpoint was broken."""
    if state not in TERMINAL:
        chosen = f"the latest application of this job, {app}," if latest else f"application {app}"
        raise YarnappError(f"{where}: checkpoint.resume: {chosen} is {state}: its checkpoints change while it "
                           f"trains; wait for it to end, or stop it first with `yarnapp kill {app}`")
