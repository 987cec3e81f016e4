"""The memory cgroup of this process: its limit, its peak and whether the kernel killed
anything in it for memory. Plain functions, no state: the agent uses them to say that a
rank was killed by its container's memory limit, the runner to report each rank's peak.

cgroup v1 (what the local engine sets up, and YARN's LinuxContainerExecutor) charges the
page cache of files read in the cgroup too: `max_usage_mib` counts it (the kernel
reclaims it before it kills anything), `rss_mib` does not (anonymous memory plus mapped
files, from memory.stat).
"""
import os

ROOT = "/sys/fs/cgroup"
NO_LIMIT = 1 << 60


def _path():
    """The directory of this process's memory cgroup, and the cgroup version (1 or 2)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None, None
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            d = os.path.join(ROOT, "memory", path.lstrip("/"))
            return (d, 1) if os.path.isdir(d) else (None, None)
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and controllers == "":
            d = os.path.join(ROOT, path.lstrip("/"))
            return (d, 2) if os.path.isfile(os.path.join(d, "memory.max")) else (None, None)
    return None, None


def _read(d, name):
    try:
        with open(os.path.join(d, name)) as f:
            return f.read()
    except OSError:
        return None


def _int(text):
    try:
        return int(text.strip())
    except (AttributeError, ValueError):
        return None


def _kv(text):
    out = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


def read():
    """{limit_mib, usage_mib, max_usage_mib, rss_mib, oom_kills, failcnt} of this process's
    memory cgroup (None for what the version does not tell), or {} without one."""
    d, version = _path()
    if d is None:
        return {}
    mib = (lambda b: None if b is None else round(b / 2 ** 20, 1))
    if version == 1:
        limit = _int(_read(d, "memory.limit_in_bytes"))
        stat = _kv(_read(d, "memory.stat"))
        return {"limit_mib": None if limit is None or limit >= NO_LIMIT else mib(limit),
                "usage_mib": mib(_int(_read(d, "memory.usage_in_bytes"))),
                "max_usage_mib": mib(_int(_read(d, "memory.max_usage_in_bytes"))),
                "rss_mib": mib(stat.get("total_rss", 0) + stat.get("total_mapped_file", 0)) if stat else None,
                "oom_kills": _kv(_read(d, "memory.oom_control")).get("oom_kill"),
                "failcnt": _int(_read(d, "memory.failcnt"))}
    limit = (_read(d, "memory.max") or "").strip()
    stat = _kv(_read(d, "memory.stat"))
    return {"limit_mib": None if limit in ("", "max") else mib(_int(limit)),
            "usage_mib": mib(_int(_read(d, "memory.current"))),
            "max_usage_mib": mib(_int(_read(d, "memory.peak"))),
            "rss_mib": mib(stat.get("anon", 0) + stat.get("file_mapped", 0)) if stat else None,
            "oom_kills": _kv(_read(d, "memory.events")).get("oom_kill"),
            "failcnt": None}


def peak_rss_mib():
    """The peak resident memory of this process (not its children), MiB."""
    import resource
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
