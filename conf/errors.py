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
    """An expected failure, reported to the user as one line."""
