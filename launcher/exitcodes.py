"""Every exit status the container side uses, and what an exit status means.

The agent (launcher.agent) ends its container with:
    SUCCEEDED   0   its rank finished in the last generation
    FAILED_HERE the rank's own exit status (>0, but 1 for a 3), or 1: this container's rank caused the failure
    APP_FAILED  3   this container is fine; the application failed elsewhere
    signalled   128 + N after SIGTERM/SIGINT (stopped by the resource manager or the user)
The rank process (launcher.rank) ends with 0, its user code's status, or 1 (RANK_FAILED).

YARN reports negative ContainerExitStatus values for containers it ended itself; those
are not the application's fault and do not spend its restart budget.
"""
import signal

SUCCEEDED = 0
RANK_FAILED = 1          # launcher.rank: the user's code or our setup failed (its line is in the store)
APP_FAILED = 3           # launcher.agent: this container is fine; the application failed elsewhere


def signalled(signum):
    """The status of a process that ends itself on signal `signum` (the shell's convention)."""
    return 128 + signum


def agent_status(failure, own_rank):
    """The agent's exit status once the application FAILED: the rank's own status (or 1)
    when this container's rank caused it, else APP_FAILED."""
    if failure is None or failure.rank != own_rank or failure.observed_by:
        return APP_FAILED
    code = failure.exit_code or 0
    return code if code > 0 and code != APP_FAILED else RANK_FAILED     # a sys.exit(3) is no "failed elsewhere"


YARN = {
    -100: ("ABORTED", "released by the resource manager", True),
    -101: ("DISKS_FAILED", "the node's disks failed", True),
    -102: ("PREEMPTED", "preempted by the scheduler", True),
    -103: ("KILLED_EXCEEDED_VMEM", "killed for exceeding its virtual memory limit", False),
    -104: ("KILLED_EXCEEDED_PMEM", "killed for exceeding its memory limit", False),
    -105: ("KILLED_BY_APPMASTER", "killed by the application master", True),
    -106: ("KILLED_BY_RESOURCEMANAGER", "killed by the resource manager", True),
    -107: ("KILLED_AFTER_APP_COMPLETION", "killed after the application completed", True),
    -108: ("KILLED_BY_CONTAINER_SCHEDULER", "killed by the container scheduler", True),
    -109: ("KILLED_FOR_EXCESS_LOGS", "killed for writing too many logs", False),
}


YARN_KILLED_EXCEEDED_VMEM, YARN_KILLED_EXCEEDED_PMEM = -103, -104   # launcher.memory names these


def describe(code, yarn=False, agent=False):
    """(text, not_our_fault) for an exit status (a Popen returncode locally, or YARN's;
    `agent`: a container's, whose agent ends with the statuses above)."""
    if code is None:
        return "still running", False
    if agent and code == APP_FAILED:
        return f"ended because the application failed elsewhere (exit {code})", False
    if yarn and code in YARN:
        name, text, external = YARN[code]
        return f"{text} ({name}, exit {code})", external
    if code < 0:
        return f"killed by signal {-code}{_name(-code)}", False
    if code > 128 and code - 128 in (9, 15):
        return f"exited with status {code} (signal {code - 128})", False
    return f"exited with status {code}", False


def _name(signum):
    try:
        return f" ({signal.Signals(signum).name})"
    except ValueError:
        return ""


def container_exit(code, yarn=False):
    """What a container's non-zero exit status means, where the number alone does not say
    (a signal, YARN's own statuses, APP_FAILED), else None."""
    text = describe(code, yarn=yarn, agent=True)[0] if code else None
    return None if text == f"exited with status {code}" else text
