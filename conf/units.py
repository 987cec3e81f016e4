"""Parsing of the human-written quantities in a job.yaml: memory, durations, rates.

Memory follows YARN and skein: a bare number is MiB; ``KiB/MiB/GiB/TiB`` and the single
letters ``K/M/G/T`` are powers of 1024, ``KB/MB/GB/TB`` powers of 1000. Anything else is
rejected, so that ``4 gigs`` never silently becomes some other amount.
"""
import math
import re

_MEM_UNITS = {
    "": 2**20, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_MEM_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_DUR_UNITS = {"ms": 0.001, "s": 1, "": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DUR_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")
# Link rates are bits per second with decimal prefixes, as tc and NIC vendors write
# them (100mbit, 1gbit, 10 Gbit/s). Bytes are refused: tc's "mbps" means megaBYTES.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)(/s)?\s*$")


def parse_memory_mib(value):
    """Return memory in MiB (rounded up) from an int (MiB) or a string like ``2 GiB``."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 512 MiB or 2 GiB")
    if isinstance(value, (int, float)):
        nbytes = float(value) * 2**20
    else:
        m = _MEM_RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _MEM_UNITS:
            raise ValueError(f"cannot parse {value!r} as memory; write e.g. 512 MiB, 2 GiB or 4 GB")
        nbytes = float(m.group(1)) * _MEM_UNITS[unit]
    if not math.isfinite(nbytes) or nbytes <= 0:
        raise ValueError(f"must be a finite size more than 0 (got {value!r})")
    return max(1, int(-(-nbytes // 2**20)))


def parse_duration_s(value, zero=False):
    """Return seconds from a number or a string like ``500ms``, ``30s``, ``2m``, ``7d``
    (more than 0, or 0 too where `zero`)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DUR_RE.match(str(value))
        if not m or m.group(2) not in _DUR_UNITS:
            raise ValueError(f"cannot parse {value!r} as a duration; write e.g. 500ms, 30s or 2m")
        seconds = float(m.group(1)) * _DUR_UNITS[m.group(2)]
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"must be a finite duration more than 0 (got {value!r})")
    return seconds


def parse_rate_bps(value):
    """Return bits per second from a number or a string like ``100mbit``, ``10 Gbit/s``."""
    if isinstance(value, bool):
        raise ValueError("expected a rate such as 100mbit, 1gbit or 10gbit")
    if isinstance(value, (int, float)):
        bps = float(value)
    else:
        m = _RATE_RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m and unit not in _RATE_UNITS and unit.rstrip("ps").lower() in ("b", "kb", "mb", "gb", "tb", "kib", "mib",
                                                                              "gib", "tib", "byte", "bytes"):
            bits = f"{float(m.group(1)) * 8:g}{unit[0].lower() if unit[0].lower() in 'kmgt' else ''}bit"
            raise ValueError(f"{value!r} is in bytes: a rate is in bits per second here, as tc writes it "
                             f"(say {bits})")
        if not m or unit not in _RATE_UNITS:
            raise ValueError(f"cannot parse {value!r} as a rate; write e.g. 100mbit, 1gbit or 10gbit (bits per second)")
        bps = float(m.group(1)) * _RATE_UNITS[unit]
    if not math.isfinite(bps) or bps <= 0:
        raise ValueError(f"must be a finite rate more than 0 (got {value!r})")
    return bps
