"""The client's errors. Their root, YarnappError, is conf.errors.YarnappError: the one
root of every package (the CLI prints `Error: <message>` and exits 1; 2 for a UsageError)."""
from conf.errors import Interrupted, YarnappError

__all__ = ["YarnappError", "Interrupted", "JobFailed", "BackendUnavailable", "WaitTimeout", "UsageError"]


class JobFailed(YarnappError):
    """The application ended FAILED; the message names the first failed container."""


class BackendUnavailable(YarnappError):
    """The chosen backend cannot be reached or set up here."""


class WaitTimeout(YarnappError, TimeoutError):
    """Run.wait(timeout=) ran out with the application still going (it runs on): caught
    as a TimeoutError, or with yarnapp's other errors. `state`: its state then."""
    state = None


class UsageError(YarnappError):
    """A command-line flag's value the command cannot take (`--tail -1`, `--timeout soon`):
    one line, exit status 2, as for the arguments argparse refuses itself."""
