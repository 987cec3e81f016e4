"""Resource enforcement for local containers, as YARN's LinuxContainerExecutor does:
vcores become a CFS CPU quota and memory a hard limit, in cgroup v1 controllers.

Where cgroups cannot be used (not root, no v1 hierarchy), `Limits.enforced` is False
and `Limits.why` says so; the container still runs, unenforced, and status shows it.
"""
import logging
import os

log = logging.getLogger(__name__)

ROOT = "/sys/fs/cgroup"
PERIOD_US = 100_000


def unavailable():
    """Why this machine's cgroups cannot enforce containers' limits, or None where they can."""
    if os.geteuid() != 0:
        return "cgroups need root"
    if not (os.path.isfile(os.path.join(ROOT, "cpu", "cpu.cfs_quota_us"))
            and os.path.isfile(os.path.join(ROOT, "memory", "memory.limit_in_bytes"))):
        return "no cgroup v1 cpu and memory controllers at /sys/fs/cgroup"
    return None


class Limits:
    def __init__(self, app_id, container, vcores, memory_mib):
        self.paths = {}
        self.enforced = False
        self.why = ""
        self.vcores, self.memory_mib = vcores, memory_mib
        name = os.path.join("yarnapp", app_id, container)
        cpu, mem = os.path.join(ROOT, "cpu"), os.path.join(ROOT, "memory")
        why_not = unavailable()
        if why_not:
            self.why = f"not enforced: {why_not}"
            return
        try:
            for ctl, base in (("cpu", cpu), ("memory", mem)):
                path = os.path.join(base, name)
                os.makedirs(path, exist_ok=True)
                self.paths[ctl] = path
            # CFS weights: a container weighs as its vcores, and the parent directories
            # as the whole machine, so that all containers together do not compete with
            # other processes as if they were a single one (cgroup v1's default 1024).
            top = os.path.join(cpu, "yarnapp")
            for parent in (top, os.path.dirname(self.paths["cpu"])):
                _write(parent, "cpu.shares", 1024 * (os.cpu_count() or 1))
            _write(self.paths["cpu"], "cpu.shares", max(2, int(1024 * vcores)))
            _write(self.paths["cpu"], "cpu.cfs_period_us", PERIOD_US)
            _write(self.paths["cpu"], "cpu.cfs_quota_us", quota_us(vcores))
            _write(self.paths["memory"], "memory.limit_in_bytes", memory_mib * 2**20)
            self.enforced = True
            self.why = f"enforced: cpu quota {vcores:g} CPU, memory limit {memory_mib} MiB (cgroup v1)"
        except OSError as e:
            self.remove()
            self.why = f"not enforced: cannot configure cgroups ({e.strerror})"

    @staticmethod
    def changed(app_id, container, vcores, memory_mib):
        """What of a running container's limits differs from what it asked for (someone wrote
        its cgroup since: status said "enforced: cpu quota 0.5 CPU" of a container throttled
        to 0.01), as words, or ""."""
        name = os.path.join("yarnapp", app_id, container)
        try:
            with open(os.path.join(ROOT, "cpu", name, "cpu.cfs_quota_us")) as f:
                quota = int(f.read())
            with open(os.path.join(ROOT, "cpu", name, "cpu.cfs_period_us")) as f:
                period = int(f.read())
            with open(os.path.join(ROOT, "memory", name, "memory.limit_in_bytes")) as f:
                limit = int(f.read()) >> 20
        except (OSError, ValueError):
            return ""
        now = quota / period if quota > 0 else None
        asked = quota_us(vcores) / PERIOD_US
        out = []
        if now is None or abs(now - asked) > 1e-6:
            out.append(f"cpu quota now {'none' if now is None else f'{now:g} CPU'}")
        if limit != memory_mib:
            out.append(f"memory limit now {limit} MiB")
        return f"{', '.join(out)}: changed from outside yarnapp" if out else ""

    def join(self, pid=0):
        """Move pid (0: the calling process) into the container's cgroups."""
        for path in self.paths.values():
            _write(path, "cgroup.procs", pid or os.getpid())

    def pids(self):
        out = set()
        for path in self.paths.values():
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    out.update(int(x) for x in f.read().split())
            except OSError:
                pass
        return out

    def remove(self):
        for path in self.paths.values():
            try:
                os.rmdir(path)
            except OSError as e:
                log.warning("could not remove cgroup %s: %s", path, e.strerror)
        self.paths = {}

    @staticmethod
    def remove_app(app_id):
        """Remove the (empty) per-application cgroup directories; returns those left
        (a cgroup that still holds a process cannot be removed)."""
        left = []
        for ctl in ("cpu", "memory"):
            path = os.path.join(ROOT, ctl, "yarnapp", app_id)
            if os.path.isdir(path):
                for d in sorted(os.listdir(path)):
                    if os.path.isdir(os.path.join(path, d)):
                        try:
                            os.rmdir(os.path.join(path, d))
                        except OSError:
                            left.append(os.path.join(path, d))
                try:
                    os.rmdir(path)
                except OSError:
                    left.append(path)
        return left


def quota_us(vcores):
    """The CFS quota of `vcores` per PERIOD_US (CFS refuses less than 1 ms)."""
    return max(1000, int(round(vcores * PERIOD_US)))


def _write(path, name, value):
    with open(os.path.join(path, name), "w") as f:
        f.write(str(value))
