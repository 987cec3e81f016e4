"""How a command waits for an application and says how it ended: `submit --wait` (which
owns it: Ctrl-C kills it) and `wait APP` (which does not: Ctrl-C, SIGTERM or --timeout stop
the wait alone). Progress goes to stderr, the last lines to stdout; a reader gone (`| head`)
is waited through."""
import sys
import time

import conf

from . import api, cli_job, interrupts
from .backends.base import TERMINAL
from .console import p as _p, readers_gone, say
from .errors import UsageError, YarnappError


def ended(run, st, took, streamed, out, resubmit=None):
    """How a waited-for application ended, as submit --wait and wait say it: 0 and its final
    metrics and model where it SUCCEEDED; else its failure's line (YarnappError: exit 1)."""
    if st["state"] != "SUCCEEDED":
        f = st.get("failure") or {}
        from .progress import rank0_streamed
        shown = (rank0_streamed(st) or {}).get("id") if streamed else None     # its output showed as it came
        if f.get("log_tail") and f.get("container") != shown:
            _p(f"--- last lines of {f.get('container')}'s log ---\n{f['log_tail']}\n---", file=sys.stderr)
        raise YarnappError(run.failure_message(resubmit=resubmit))
    formed = st.get("world_formed_s")
    out = say(f"{run.app_id} SUCCEEDED" + (f" in {took:.1f}s" if took is not None else "")
              + (f" (world formed in {formed:.2f}s after submit)" if formed else ""), out)
    if st.get("final"):
        from .progress import final_model, metrics
        out = say("final: " + metrics(st["final"]), out)
        model = final_model(st)
        if model:
            say(model, out)
    return 0


def watch(run, ctrl_c, timeout=None):
    """Wait for `run`, showing its progress, as submit --wait and wait do: (its last status,
    whether rank 0's output was shown as it came, the stream to say its end on). Its reader
    gone (`| head`; gone already, `| true`: the lines after go to stderr), it waits on, silent."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        return run.wait(timeout=timeout, progress=True, summary=False), True, sys.stdout   # (its lines: stdout)
    except BrokenPipeError:
        out = readers_gone() or sys.stdout
        say(f"output closed; still waiting for {run.app_id} ({ctrl_c})", out)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return run.wait(timeout=left, summary=False), False, out


def cmd_wait(args):
    """Wait for an application submitted without --wait (`app=$(yarnapp submit job.yaml)`), as
    submit --wait does, but an interrupted wait leaves it running: it is not this command's."""
    from .errors import WaitTimeout
    timeout = None if args.timeout is None else _duration("--timeout", args.timeout)
    run = api.Run(args.app)
    first = run.status()                 # (an unknown id: one line, before any wait)
    interrupts.sigterm_stops_command()
    try:
        st, streamed, out = watch(run, "Ctrl-C stops the wait", timeout)
    except WaitTimeout as e:
        _p(f"Error: {args.app} still {e.state} after --timeout {args.timeout}; it runs on "
           f"(`yarnapp kill {args.app}` stops it)", file=sys.stderr)
        return TIMEOUT_STATUS
    except (KeyboardInterrupt, api.Interrupted):
        say(f"stopped waiting for {args.app}, which runs on: `yarnapp kill {args.app}` stops it", sys.stderr)
        return interrupts.command_interrupted_status()
    ran = first["state"] not in TERMINAL and first.get("submitted")    # it ended now: the time it took
    return ended(run, st, time.time() - first["submitted"] if ran else None, streamed, out,
                  resubmit=cli_job.submitted_as(st))


TIMEOUT_STATUS = 124        # as timeout(1): `wait --timeout` ran out, the application runs on


def _duration(flag, text):
    try:
        return conf.parse_duration_s(text)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{flag} {text}: {e}") from None
