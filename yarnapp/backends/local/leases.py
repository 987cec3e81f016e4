"""The local engine's ledger of the machine's GPUs and memory, as one NodeManager keeps its
node's: no two containers share a GPU, and the applications running together never hold
more memory than the machine has.

Every application's master leases, before it starts its containers, the whole GPUs and the
memory (the sum of its containers' `memory`) they ask for, from one ledger of the machine
($YARNAPP_LEDGER, else <tmp>/yarnapp-leases/leases.json, under an flock: every user's
engine, whatever its YARNAPP_HOME, sees the same machine). One that does not fit beside
the others waits (ACCEPTED, saying for whom) until they end, in line: first come, first
served for what it waits for (a later application never takes the GPUs, or the memory,
an earlier one waits for, even where it would fit: a stream of small jobs would keep a
large one waiting for ever; one that needs neither passes it). A lease of a master that is
gone is free again. A job asking for more than the machine has in all is refused at
submit (yarnapp.backends.local.engine.check_resources). A CPU quota is a cap, not a
reservation: vcores are shared, as YARN's default scheduler shares them (it counts
memory only). (Every local user may write the ledger: it keeps engines apart, it does not
police users; a cluster's resources are YARN's.)
"""
import contextlib
import fcntl
import json
import os
import tempfile
import time

import psutil


class Leases:
    """The machine's ledger: which application's master holds which GPU indices and how much
    memory, and which wait, in the order they asked."""

    def __init__(self, path=None):
        self.path = path or os.environ.get("YARNAPP_LEDGER") or \
            os.path.join(tempfile.gettempdir(), "yarnapp-leases", "leases.json")

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

    def acquire(self, app_id, count=0, gpus=(), memory=0, capacity=None, pid=None):
        """Lease `count` GPUs of inventory `gpus` and `memory` MiB of the machine's `capacity`
        (None: not counted) to app_id: (its GPU indices, [], [], []), or (None, whose leases
        stand in the way, the applications in line before it, what is short now: "gpus",
        "memory") when it must wait: too few GPUs or too little memory are free now, or
        another waits for what it would take."""
        with self._locked() as ledger:
            held, waiting = ledger["held"], ledger["waiting"]
            if app_id in held:
                return held[app_id]["gpus"], [], [], []
            me = waiting.setdefault(app_id, {"pid": pid or os.getpid(), "since": time.time()})
            free = [g.index for g in gpus if g.index not in {i for v in held.values() for i in v["gpus"]}]
            short = ["gpus"] * (len(free) < count) + ["memory"] * (
                capacity is not None and sum(v.get("memory", 0) for v in held.values()) + memory > capacity)
            me["short"] = short
            ahead = sorted((w["since"], app) for app, w in waiting.items() if app != app_id and w["since"] < me["since"]
                           and ("gpus" in w.get("short", ()) and count or "memory" in w.get("short", ()) and memory))
            if ahead or short:
                return None, sorted(app for app, v in held.items() if "gpus" in short and v["gpus"]
                                    or "memory" in short and v.get("memory")), [app for _, app in ahead], short
            waiting.pop(app_id)
            held[app_id] = {"pid": pid or os.getpid(), "gpus": free[:count], "memory": memory}
            return free[:count], [], [], []

    def release(self, app_id):
        with self._locked() as ledger:
            ledger["held"].pop(app_id, None)
            ledger["waiting"].pop(app_id, None)

    def held(self):
        """{application: {"gpus": indices, "memory": MiB}} of the leases held now."""
        with self._locked() as ledger:
            return {app: {"gpus": v["gpus"], "memory": v.get("memory", 0)} for app, v in ledger["held"].items()}


def machine_memory_mib():
    """The memory the local engine offers: the machine's."""
    return psutil.virtual_memory().total // 2**20
