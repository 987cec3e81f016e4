"""One exception root for the client. The CLI prints `Error: <message>` and exits 1."""


class YarnappError(Exception):
    """Expected failures: bad input, unknown application, unreachable cluster..."""


class JobFailed(YarnappError):
    """The application ended FAILED; the message names the first failed container."""


class BackendUnavailable(YarnappError):
    """The chosen backend cannot be reached or set up here."""
