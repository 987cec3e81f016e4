"""The local engine's GPUs: an inventory, and how a lease of them is handed to containers
(the leases themselves: yarnapp.backends.local.leases, with the machine's memory).

Inventory (`inventory()`): the GPUs `nvidia-smi` lists, as
`nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`
prints them, narrowed to CUDA_VISIBLE_DEVICES when this process has one (indices or
UUIDs). YARNAPP_GPUS, a comma-separated list of GPU indices, replaces nvidia-smi (for
machines whose driver tools are elsewhere, and for tests). The client never imports
torch, so the inventory never comes from it.

Each container gets exactly the GPUs leased for it through CUDA_VISIBLE_DEVICES (a
container without GPUs gets an empty CUDA_VISIBLE_DEVICES: it sees none).
"""
import dataclasses
import os
import subprocess

QUERY = ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_mib: int


def _from_nvidia_smi():
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            try:
                mem = int(float(parts[3]))
            except ValueError:
                mem = 0
            gpus.append(Gpu(int(parts[0]), parts[1], parts[2], mem))
    return gpus


def inventory(environ=None):
    """The GPUs this engine may hand out, in index order."""
    env = os.environ if environ is None else environ
    given = env.get("YARNAPP_GPUS")
    if given is not None:
        gpus = [Gpu(i, f"GPU-{i}", "given by YARNAPP_GPUS", 0) for i in given_indices(given)]
    else:
        gpus = _from_nvidia_smi()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        allowed = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for g in gpus if str(g.index) in allowed or g.uuid in allowed]
    return gpus


def source(environ=None):
    """Where inventory() found its GPUs, as messages say it."""
    env = os.environ if environ is None else environ
    found = "YARNAPP_GPUS" if env.get("YARNAPP_GPUS") is not None else "nvidia-smi"
    return found + (f", within CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
                    if env.get("CUDA_VISIBLE_DEVICES") is not None else "")


def given_indices(text):
    """YARNAPP_GPUS's indices; YarnappError for what is not a list of distinct indices (`all`,
    NVIDIA_VISIBLE_DEVICES's habit, was a traceback; `0,0` gave one GPU to two containers)."""
    from ...errors import YarnappError
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts) or len(set(map(int, parts))) != len(parts):
        raise YarnappError(f"YARNAPP_GPUS={text!r}: not a list of distinct GPU indices such as 0,1; give the indices "
                           f"this machine's engine may hand out, or unset it to ask nvidia-smi")
    return [int(p) for p in parts]


def split(indices, requests):
    """Hand out `indices` to containers in order: requests = [gpus of each container];
    returns one list of indices per container."""
    out, at = [], 0
    for n in requests:
        out.append(indices[at:at + n])
        at += n
    return out


def visible_devices(assigned):
    """CUDA_VISIBLE_DEVICES for a container holding `assigned` (none: it sees no GPU)."""
    return ",".join(str(i) for i in assigned)
