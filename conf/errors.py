"""The one exception root of yarnapp.

Every error that yarnapp expects (bad input: a job.yaml field, a CLI argument, a
missing or corrupt data file, an unreachable URI, an impossible resource request; a
failed application) derives from YarnappError. Its str() is one line naming the file
or field and what to do; the CLI prints it as `Error: ...` and exits 1. Anything else
is a bug, and keeps its traceback.

It lives in `conf` because conf imports nothing of ours and every other package may
import conf: the client (yarnapp), the container side (launcher) and training share it.
"""


class YarnappError(Exception):
    """An expected failure, reported to the user as one line. `app_id`: the application it
    is about, where there is one (JobFailed, WaitTimeout: a sweep's driver collects them
    without parsing the line)."""

    app_id = None

    def __init__(self, *args, app_id=None):
        Exception.__init__(self, *args)
        self.app_id = app_id

    def _render_traceback_(self):
        """What IPython and Jupyter show instead of a traceback: the one line (the frame that
        raised it is the user's call of our API: IPython never hides a traceback's last frame)."""
        return [f"{type(self).__name__}: {self}"]


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt our API raises after acting on one (it killed the application
    `app_id`, or left it running): its one line in a notebook, as YarnappError's."""

    def __init__(self, *args, app_id=None):
        KeyboardInterrupt.__init__(self, *args)
        self.app_id = app_id

    app_id = None
    _render_traceback_ = YarnappError._render_traceback_
