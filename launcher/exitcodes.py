"""What a container's exit status means, YARN's special codes included.

YARN reports negative ContainerExitStatus values for containers it ended itself;
those are not the application's fault and do not spend its restart budget.
"""

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


def describe(code, yarn=False):
    """(text, not_our_fault) for an exit status (a Popen returncode locally, or YARN's)."""
    if code is None:
        return "still running", False
    if yarn and code in YARN:
        name, text, external = YARN[code]
        return f"{text} ({name}, exit {code})", external
    if code < 0:
        return f"killed by signal {-code}", False
    if code > 128 and code - 128 in (9, 15):
        return f"exited with status {code} (signal {code - 128})", False
    return f"exited with status {code}", False
