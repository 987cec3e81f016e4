"""The coordination store: the one interface through which containers reach their
application. Skein's key-value store provides it on YARN; a directory provides it on
the local engine. Values are bytes; `owned` keys disappear when their container exits.
"""
import abc
import os
import threading
import time
import urllib.parse


class Store(abc.ABC):
    # Seconds the resource manager may take to report a container that died (its owned keys
    # gone, its abort written): how long an agent whose rank died waits for a dead peer to
    # show before it names its own rank (launcher.monitor.Monitor.monitor). YARN: a node
    # manager's heartbeat, then the master's allocate call.
    death_notice_s = 6.0

    @abc.abstractmethod
    def put(self, key, value, owned=False):
        """Set key to value (bytes or str). Owned keys vanish when this container exits."""

    @abc.abstractmethod
    def get(self, key, default=None):
        """Return the value (bytes) or default."""

    @abc.abstractmethod
    def put_if_absent(self, key, value, owned=False):
        """Set key only if it does not exist. Return True if this call set it."""

    @abc.abstractmethod
    def get_prefix(self, prefix):
        """Return {key: value} for every key starting with prefix."""

    @abc.abstractmethod
    def delete(self, key):
        """Remove key if present."""

    def delete_prefixes(self, prefixes):
        """Remove every key under any of `prefixes`."""
        for key in self.snapshot(prefixes=prefixes):
            self.delete(key)

    def snapshot(self, prefixes=(), keys=()):
        """{key: value} of every key under any of `prefixes` and of each of `keys` that exists,
        read in ONE call (on skein one RPC: a transaction of reads), so that a poller's store
        traffic does not grow with the number of members it watches."""
        out = {}
        for p in prefixes:
            out.update(self.get_prefix(p))
        for k in keys:
            v = self.get(k)
            if v is not None:
                out[k] = v
        return out

    def replace_container(self, engine_id, group, instances):
        """Ask the resource manager to replace the container `engine_id` of `group` (of
        `instances`), whose agent went silent (launcher.keys.replace is the request every
        engine can read). The local engine's master watches those keys and replaces it
        itself: nothing to do here."""

    def starting(self, groups):
        """(how many containers of `groups` the resource manager has yet to start, when the
        last of those running started: epoch seconds or None). The local engine's master
        starts a job's containers together, before its ranks: (0, None)."""
        return 0, None

    def memory_kill(self, group, since):
        """YARN's verdict where its NodeManager killed the container of `group` that ended
        last, after `since` (epoch seconds), for its memory: (its usage in bytes, or None; its
        words), or None. The local engine's master reads its cgroups instead: None here."""
        return None

    def unheard(self, groups, heard, older_than):
        """The containers of `groups` the resource manager has run for more than `older_than`
        seconds whose engine ids are not in `heard` (their agents never beat: frozen or stuck
        as they started): [(engine_id, group)]. The local engine's master starts every
        container and replaces those itself (ApplicationMaster.never_beaten): none here."""
        return []

    def wait(self, key, timeout=None, interval=0.01, cancel=None):
        """Block until key exists and return its value.

        Raises TimeoutError after `timeout` seconds; returns None early if `cancel()`
        becomes true (used to stop waiting once the generation is aborted).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            value = self.get(key)
            if value is not None:
                return value
            if cancel is not None and cancel():
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f}s for {key!r}")
            time.sleep(interval)
            interval = min(interval * 1.5, 0.1)


def _b(value):
    return value.encode() if isinstance(value, str) else bytes(value)


class FileStore(Store):
    """A store in a directory (the local engine's). Writes are atomic renames.

    Owned keys are listed under `owners/<container>`; the application master calls
    `release(container)` when that container exits, as YARN does for skein.
    """

    death_notice_s = 1.0     # the local master sees a container's end at once (launcher.procs.wait_exit)

    def __init__(self, root, container=None):
        self.root = root
        self.container = container
        self._owned = set()          # keys this process has listed as owned already
        os.makedirs(os.path.join(root, "kv"), exist_ok=True)
        os.makedirs(os.path.join(root, "owners"), exist_ok=True)

    def _path(self, key):
        return os.path.join(self.root, "kv", urllib.parse.quote(key, safe=""))

    def _tmp(self, value):
        tmp = os.path.join(self.root, f".tmp.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:   # whatever the umask
            f.write(_b(value))
        return tmp

    def _own(self, key):
        if self.container and key not in self._owned:     # a key put every second is listed once
            self._owned.add(key)
            with open(os.path.join(self.root, "owners", self.container), "a") as f:
                f.write(key + "\n")

    def put(self, key, value, owned=False):
        if owned:
            self._own(key)
        os.replace(self._tmp(value), self._path(key))

    def put_if_absent(self, key, value, owned=False):
        tmp = self._tmp(value)
        try:
            os.link(tmp, self._path(key))
            if owned:
                self._own(key)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get(self, key, default=None):
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return default

    def get_prefix(self, prefix):
        out = {}
        for name in sorted(os.listdir(os.path.join(self.root, "kv"))):
            key = urllib.parse.unquote(name)
            if key.startswith(prefix):
                value = self.get(key)
                if value is not None:
                    out[key] = value
        return out

    def snapshot(self, prefixes=(), keys=()):
        wanted = set(keys)
        out = {}
        for name in os.listdir(os.path.join(self.root, "kv")):
            key = urllib.parse.unquote(name)
            if key in wanted or key.startswith(tuple(prefixes)):
                value = self.get(key)
                if value is not None:
                    out[key] = value
        return out

    def delete(self, key):
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def delete_prefixes(self, prefixes):
        for name in os.listdir(os.path.join(self.root, "kv")):
            if urllib.parse.unquote(name).startswith(tuple(prefixes)):
                self.delete(urllib.parse.unquote(name))

    def release(self, container):
        """Delete every key the container owned (called when it exits)."""
        path = os.path.join(self.root, "owners", container)
        try:
            with open(path) as f:
                keys = set(f.read().split())
        except FileNotFoundError:
            return
        for key in keys:
            self.delete(key)
        os.unlink(path)


class SkeinStore(Store):
    """Skein's application key-value store, as seen from inside a YARN container."""

    def __init__(self, app_client=None, container=None):
        import skein  # lazy: only on YARN
        self._skein = skein
        self.app = app_client or skein.ApplicationClient.from_current()
        self.container = container or os.environ.get("SKEIN_CONTAINER_ID")

    def put(self, key, value, owned=False):
        self.app.kv.put(key, _b(value), owner=self.container if owned else None)
        if key == "progress/00000":           # keys.progress(0): rank 0's is the application's
            self._progress(value)

    def _progress(self, value):
        import json
        try:
            rec = json.loads(value)
            if rec.get("total_steps"):
                self.set_progress(rec["step"] / rec["total_steps"])
        except (ValueError, TypeError, KeyError, self._skein.exceptions.SkeinError):
            pass

    def get(self, key, default=None):
        value = self.app.kv.get(key)
        return default if value is None else value

    def put_if_absent(self, key, value, owned=False):
        # skein.kv's module-level operations build a transaction; the store object's
        # methods of the same names would run at once.
        ops = self._skein.kv
        owner = self.container if owned else None
        res = self.app.kv.transaction(conditions=[ops.missing(key)],
                                      on_success=[ops.put(key, _b(value), owner=owner)])
        return bool(res.succeeded)

    def get_prefix(self, prefix):
        return dict(self.app.kv.get_prefix(prefix))

    def snapshot(self, prefixes=(), keys=()):
        ops = self._skein.kv
        res = self.app.kv.transaction(on_success=[ops.get_prefix(p) for p in prefixes] + [ops.get(k) for k in keys])
        out = {}
        for r in res.results[:len(prefixes)]:
            out.update(r)
        out.update({k: v for k, v in zip(keys, res.results[len(prefixes):]) if v is not None})
        return out

    def replace_container(self, engine_id, group, instances):
        # Skein does not restart a container it killed on request: a new instance of the
        # service is added, and its agent adopts the freed slot (launcher.identity.adopt),
        # unless skein has started one already (it had seen the container fail).
        self.app.kill_container(engine_id)
        if len(self.app.get_containers(services=[group])) < instances:     # waiting, requested, running
            self.app.add_container(group)

    def starting(self, groups):
        containers = self.app.get_containers(services=groups, states=["WAITING", "REQUESTED", "RUNNING"])
        waiting = sum(str(c.state) != "RUNNING" for c in containers)
        starts = [c.start_time.timestamp() for c in containers if str(c.state) == "RUNNING" and c.start_time]
        return waiting, max(starts, default=None)

    def memory_kill(self, group, since):
        from . import memory
        ended = [c for c in self.app.get_containers(services=[group], states=["FAILED", "KILLED"])
                 if c.finish_time is not None and c.finish_time.timestamp() >= since]
        if not ended:
            return None
        last = max(ended, key=lambda c: c.finish_time)
        words = memory.yarn_memory_kill(last.exit_message, None, last.id, group)
        return (memory.yarn_used_bytes(last.exit_message), words) if words else None

    def unheard(self, groups, heard, older_than):
        # skein's start_time is the master's clock: hosts of one cluster keep theirs in step
        # (NTP) well within a limit of 10 s or more.
        now = time.time()
        return [(c.id, c.service_name) for c in self.app.get_containers(services=groups, states=["RUNNING"])
                if c.id not in heard and c.start_time is not None and now - c.start_time.timestamp() > older_than]

    def set_progress(self, fraction):
        """The application's progress as YARN shows it (0..1)."""
        self.app.set_progress(max(0.0, min(1.0, float(fraction))))

    def delete(self, key):
        self.app.kv.discard(key)

    def delete_prefixes(self, prefixes):
        ops = self._skein.kv
        self.app.kv.transaction(on_success=[ops.discard_prefix(p) for p in prefixes])     # one RPC


def from_env(environ=None):
    """The store of the container this process runs in."""
    env = os.environ if environ is None else environ
    root = env.get("YARNAPP_STORE")
    container = env.get("YARNAPP_CONTAINER_ID")
    if root:
        return FileStore(root, container)
    return SkeinStore(container=container)
