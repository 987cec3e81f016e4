"""The local engine's GPUs: an inventory, and leases so that no two containers share one.

Inventory (`inventory()`): the GPUs `nvidia-smi` lists, as
`nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`
prints them, narrowed to CUDA_VISIBLE_DEVICES when this process has one (indices or
UUIDs). YARNAPP_GPUS, a comma-separated list of GPU indices, replaces nvidia-smi (for
machines whose driver tools are elsewhere, and for tests). The client never imports
torch, so the inventory never comes from it.

Leases (`Leases`): every application's master leases whole GPUs for its containers
from one ledger of the machine ($YARNAPP_GPU_LEDGER, else <tmp>/yarnapp-gpus/gpus.json,
under an flock: every user's engine, whatever its YARNAPP_HOME, sees the same GPUs), and
gives each container exactly its own through CUDA_VISIBLE_DEVICES (a container without
GPUs gets an empty CUDA_VISIBLE_DEVICES: it sees none). A lease of a master that is gone
is free again. A job asking for more GPUs than the machine has is refused at submit; one
whose GPUs are leased to another application waits (ACCEPTED) until they are free, in
line: first come, first served (a later application never takes GPUs before one that
asked first, even where it would fit: a stream of small jobs would keep a large one
waiting for ever). A GPU is never shared silently. (Every local user may write the
ledger: it keeps engines apart, it does not police users; a cluster's GPUs are YARN's.)
"""
import contextlib
import dataclasses
import fcntl
import json
import os
import subprocess
import tempfile
import time

import psutil

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
        gpus = [Gpu(int(i), f"GPU-{int(i)}", "given by YARNAPP_GPUS", 0)
                for i in given.split(",") if i.strip()]
    else:
        gpus = _from_nvidia_smi()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        allowed = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for g in gpus if str(g.index) in allowed or g.uuid in allowed]
    return gpus


class Leases:
    """The machine's ledger: which application's master holds which GPU indices, and which
    wait for some, in the order they asked."""

    def __init__(self, path=None):
        self.path = path or os.environ.get("YARNAPP_GPU_LEDGER") or \
            os.path.join(tempfile.gettempdir(), "yarnapp-gpus", "gpus.json")

    @contextlib.contextmanager
    def _locked(self):
        """The ledger, read and written back in place under the lock: every user's engine
        writes it, and in the sticky folder only a file's owner may rename over it."""
        folder = os.path.dirname(self.path)
        if not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            with contextlib.suppress(OSError):      # every user's engine writes it (as /tmp is)
                os.chmod(folder, 0o1777)
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(self.path, "a+") as f:
                    for made in (lock.name, self.path):     # only its creator may; the umask left alone
                        with contextlib.suppress(OSError):
                            os.chmod(made, 0o666)
                    f.seek(0)
                    try:
                        ledger = json.loads(f.read() or "{}")
                    except ValueError:
                        ledger = {}
                    # a lease or a place in line whose master is gone is free again
                    ledger = {part: {app: v for app, v in (ledger.get(part) or {}).items()
                                     if psutil.pid_exists(v["pid"])} for part in ("held", "waiting")}
                    yield ledger
                    f.seek(0)
                    f.truncate()
                    f.write(json.dumps(ledger))
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def acquire(self, app_id, count, gpus, pid=None):
        """Lease `count` GPUs of inventory `gpus` to app_id: (their indices, [], []), or
        (None, whose leases stand in the way, the applications in line before it) when it
        must wait: not enough are free now, or another asked first."""
        with self._locked() as ledger:
            held, waiting = ledger["held"], ledger["waiting"]
            if app_id in held:
                return held[app_id]["gpus"], [], []
            me = waiting.setdefault(app_id, {"pid": pid or os.getpid(), "since": time.time(), "count": count})
            ahead = sorted((w["since"], app) for app, w in waiting.items() if app != app_id and w["since"] < me["since"])
            taken = {i for v in held.values() for i in v["gpus"]}
            free = [g.index for g in gpus if g.index not in taken]
            if ahead or len(free) < count:
                return None, sorted(held), [app for _, app in ahead]
            waiting.pop(app_id)
            held[app_id] = {"pid": pid or os.getpid(), "gpus": free[:count]}
            return free[:count], [], []

    def release(self, app_id):
        with self._locked() as ledger:
            ledger["held"].pop(app_id, None)
            ledger["waiting"].pop(app_id, None)

    def held(self):
        with self._locked() as ledger:
            return {app: v["gpus"] for app, v in ledger["held"].items()}


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
