"""Whether this container was killed for its memory, from its own cgroup (v1).

The local engine puts every container in a memory cgroup whose limit is the group's
`memory` (yarnapp.backends.local.cgroups). When the container crosses it, the kernel's
OOM killer SIGKILLs a process of it, and the cgroup counts it: `memory.oom_control`'s
`oom_kill`, and `memory.max_usage_in_bytes` holds the peak. A process reads its own
cgroup from /proc/self/cgroup, so the agent can tell "killed by signal 9" from "killed
for exceeding its memory limit" and say which limit to raise.
"""
import collections
import os
import re
import subprocess
import time

from . import exitcodes
from .procs import resident_bytes, stopped

ROOT = "/sys/fs/cgroup/memory"


def own_cgroup(proc_cgroup="/proc/self/cgroup"):
    """The directory of this process's memory cgroup (v1) where it is the container's, one
    with a memory limit; else None. A cgroup without one is the host's or a session's (YARN
    without cgroups enforcement): its peaks were every process's there (a 1 GiB container
    said it peaked at 2679 MiB), and its OOM kills anybody's."""
    try:
        with open(proc_cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    d = os.path.join(ROOT, path.lstrip("/"))
                    with open(os.path.join(d, "memory.limit_in_bytes")) as limit:
                        return d if int(limit.read()) < UNLIMITED else None
    except (OSError, ValueError):
        return None
    return None


UNLIMITED = 1 << 60     # memory.limit_in_bytes of a cgroup without a limit: 2^63 rounded to pages


def state(cgroup):
    """{"limit", "peak", "usage" (bytes), "oom_kills"} of a memory cgroup, or None."""
    if not cgroup:
        return None
    try:
        def read(name):
            with open(os.path.join(cgroup, name)) as f:
                return f.read()
        oom = dict(line.split() for line in read("memory.oom_control").splitlines() if line.strip())
        return {"limit": int(read("memory.limit_in_bytes")), "peak": int(read("memory.max_usage_in_bytes")),
                "usage": int(read("memory.usage_in_bytes")), "oom_kills": int(oom.get("oom_kill", 0))}
    except (OSError, ValueError):
        return None


def mib(nbytes):
    return -(-int(nbytes) // 2**20)


def killed_for_memory(before, after, container, group_index):
    """The phrase naming a memory kill between two `state`s, or None if the cgroup's OOM
    killer did not act: '<container> exceeded its memory limit of L MiB (peak P MiB):
    raise groups[i].memory'."""
    if not before or not after or after["oom_kills"] <= before["oom_kills"]:
        return None
    return (f"{container} exceeded its memory limit of {mib(after['limit'])} MiB "
            f"(peak {mib(after['peak'])} MiB): raise groups[{group_index}].memory")


class Held:
    """What a container's processes held (resident memory, as YARN's NodeManager adds it up)
    at most over the last WINDOW_S seconds, sampled at most once a second (`sample`, from
    the agent's polls): at a SIGTERM the rank may be gone already (the NodeManager signals
    the container's whole process group), and what it held is what the NodeManager counted.
    A rank that grew and was stopped between two samples (the NodeManager looks every 3 s)
    left its own peak, which `at_stop` adds."""
    WINDOW_S = 10.0

    def __init__(self, pid):
        self.pid, self.samples = pid, collections.deque()

    def sample(self, force=False):
        now = time.monotonic()
        if force or not self.samples or now - self.samples[-1][0] >= 1.0:
            held = resident_bytes(self.pid)
            if held is not None:
                self.samples.append((now, held))
        while self.samples and now - self.samples[0][0] > self.WINDOW_S:
            self.samples.popleft()

    def peak(self):
        self.sample(force=True)
        return max((held for _, held in self.samples), default=None)

    def at_stop(self, rank, wait_s, enough):
        """At a SIGTERM: the most held. Where the samples show no more than `enough` bytes
        (the allocation: nothing to wait for above it) and `rank` (the rank's Popen, signalled
        with this process) ends within `wait_s`, its own peak counts too, with what the rest
        of the container holds now."""
        held = self.peak()
        if held is not None and held > enough:
            return held
        own = reap_peak(rank, wait_s)
        return held if own is None else max(held or 0, own + (resident_bytes(self.pid) or 0))


def reap_peak(popen, wait_s):
    """The peak resident bytes of a Popen's process, reaped here once it ends within `wait_s`
    (its returncode set, as Popen sets it): os.wait4's usage is that child's own, where
    getrusage's RUSAGE_CHILDREN is the largest of every child reaped so far. None where it
    was reaped already, is no Popen, is stopped or runs on."""
    if not isinstance(popen, subprocess.Popen) or popen.returncode is not None or stopped(popen.pid):
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, status, usage = os.wait4(popen.pid, os.WNOHANG)
        except ChildProcessError:       # (reaped by its Popen, interrupted by this signal's handler)
            return None
        if pid:
            popen.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_maxrss * 1024                   # (KiB on Linux)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


STEP_ENV = "YARNAPP_MEMORY_STEP_MB"     # the client's yarn.scheduler.minimum-allocation-mb, for the agents
STEP_MB = 1024                          # YARN's default for it


def yarn_step_mib():
    """The MiB YARN rounds this container's memory up to a multiple of (the client says)."""
    return int(os.environ.get(STEP_ENV, STEP_MB))


def allocated_mib(asked_mib, step_mib=STEP_MB):
    """The MiB YARN allocates for `asked_mib`: rounded up to a multiple of `step_mib`."""
    return -(-asked_mib // step_mib) * step_mib


def stopped_for_memory(held, asked_mib, group_index, step_mib=STEP_MB):
    """At a SIGTERM on YARN: the phrase naming a container stopped for its memory, or None.
    The NodeManager's memory check adds up the resident memory of the container's processes
    every few seconds and stops one above its allocation as it stops any container (a
    preemption spends no restart: one stopped for its memory was retried until skein's own
    restarts ran out, then a second master attempt ran the application again). The allocation
    is the group's `memory` rounded up to a multiple of `step_mib` (the scheduler's minimum
    allocation, YARNAPP_MEMORY_STEP_MB from the client's yarn-site.xml; YARN's default 1024):
    a container that held more (`held` bytes) was over it, whatever stopped it; one that held
    less is taken as stopped by the resource manager, as before:
    'was stopped by YARN holding H MiB, above its memory of M MiB ...: raise groups[i].memory'."""
    if held is None or held <= allocated_mib(asked_mib, step_mib) * 2**20:
        return None
    return (f"was stopped by YARN holding {mib(held)} MiB, above its memory of {asked_mib} MiB "
            f"(the NodeManager's memory check): raise groups[{group_index}].memory")


def resident(cgroup):
    """Bytes of the cgroup's anonymous and mapped-file memory (memory.stat: total_rss +
    total_mapped_file): what its processes hold, without the reclaimable page cache that
    `peak` (memory.max_usage_in_bytes) also counts. None without a cgroup."""
    if not cgroup:
        return None
    try:
        with open(os.path.join(cgroup, "memory.stat")) as f:
            stat = dict(line.split() for line in f if line.strip())
        return int(stat.get("total_rss", 0)) + int(stat.get("total_mapped_file", 0))
    except (OSError, ValueError):
        return None


_YARN_BEYOND = re.compile(r"beyond the '(PHYSICAL|VIRTUAL)' memory limit|beyond (physical|virtual) memory limits",
                          re.IGNORECASE)
_YARN_USAGE = re.compile(r"(?:Current usage: |^)([\d.]+) ?([KMGTP]?)B of ([\d.]+) ?([KMGTP]?)B (physical|virtual) "
                         r"memory used", re.IGNORECASE)     # (skein's master says the usage alone)
_UNITS = {"": 2**-20, "K": 2**-10, "M": 1, "G": 2**10, "T": 2**20, "P": 2**30}


def _yarn_usage(diagnostics, kind="physical"):
    """(used, limit) MiB of `kind` memory as YARN's words say, or None."""
    usage = next((m for m in _YARN_USAGE.finditer(diagnostics or "") if m.group(5).lower() == kind), None)
    if usage is None:
        return None
    return (float(usage.group(1)) * _UNITS[usage.group(2).upper()],
            float(usage.group(3)) * _UNITS[usage.group(4).upper()])


def yarn_used_bytes(diagnostics):
    """The physical memory YARN's words say a container used, in bytes, or None."""
    usage = _yarn_usage(diagnostics)
    return int(usage[0] * 2**20) if usage else None


def yarn_memory_kill(diagnostics, exit_code, container, group):
    """The phrase naming a container YARN's NodeManager killed for its memory, from its
    exit status (-104 KILLED_EXCEEDED_PMEM, -103 VMEM) or the NodeManager's diagnostics
    ("Container [pid=..] is running 5B beyond the 'PHYSICAL' memory limit. Current usage:
    1.0 GB of 1 GB physical memory used; ..."), or None: '<container> exceeded its memory
    limit of L MiB (peak P MiB): raise the memory of group <group>'."""
    text = diagnostics or ""
    beyond = _YARN_BEYOND.search(text)
    alone = _YARN_USAGE.match(text)     # skein's master's words for the kill: "1.6 GB of 512 MB physical memory used"
    if alone and not beyond and exit_code is None:
        exit_code = exitcodes.YARN_KILLED_EXCEEDED_PMEM if alone.group(5).lower() == "physical" \
            else exitcodes.YARN_KILLED_EXCEEDED_VMEM
    if not beyond and exit_code not in (exitcodes.YARN_KILLED_EXCEEDED_VMEM, exitcodes.YARN_KILLED_EXCEEDED_PMEM):
        return None
    kind = ((beyond.group(1) or beyond.group(2)) if beyond
            else ("virtual" if exit_code == exitcodes.YARN_KILLED_EXCEEDED_VMEM else "physical")).lower()
    what = "memory limit" if kind == "physical" else "virtual memory limit"
    usage = _yarn_usage(text, kind)
    sizes = f" of {usage[1]:.0f} MiB (peak {usage[0]:.0f} MiB)" if usage else ""
    return f"{container} exceeded its {what}{sizes}: raise the memory of group {group}"
