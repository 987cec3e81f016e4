"""The container agent: the main process of every container, on both engines.

It is a loop around an explicit state machine (as torchrun's agent):

    START ──► RENDEZVOUS(gen) ──► RUNNING(gen) ──► SUCCEEDED          (exit 0)
                  ▲                   │
                  │                   ├─ own rank crashed / hung / world not formed
                  │                   │     → write abort(gen) (first writer wins)
                  │                   ├─ abort(gen) written by another agent
                  │                   ├─ a member's container was lost
                  │                   ▼
                  └──── RESTARTING: kill own rank; gen += 1 while gen <= max_restarts
                                      otherwise FAILED                 (exit 1)

START: publish `alive/<container>` (owned: the resource manager deletes it when the
container exits) and find the current generation (the first without an abort key).
RENDEZVOUS/RUNNING: the rank process (launcher.rank) joins world `gen` and trains;
the agent watches its exit status, its heartbeat file and the store.
A rank never hangs forever: whatever aborts the generation, every agent kills its
own rank, so survivors blocked inside a collective are ended.
"""
import ctypes
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import uuid

from . import identity, keys, memory, network, results, store as store_mod

log = logging.getLogger("launcher.agent")

EXIT_APP_FAILED = 3      # this container is fine; the application failed elsewhere
_PR_SET_PDEATHSIG = 1
SETUP_GRACE_S = 8.0      # after a peer failed in setup, how long a rank in setup may take to fail
                         # the same way on its own (ranks start seconds apart on a busy host)
NOT_RETRIED = ("every rank failed the same way before training started, so it was not retried "
               "(a restart would fail the same way)")


def die_with_parent():
    """preexec_fn: SIGKILL this child when its parent dies (no orphans)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def current_generation(store):
    aborted = {k.split("/")[1] for k in store.get_prefix(keys.ABORT_PREFIX) if k.endswith("/abort")}
    gen = 0
    while f"{gen:04d}" in aborted:
        gen += 1
    return gen


def process_state(pid):
    """The one-letter state of a process (R, S, D, T for stopped...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def spent_restarts(store, upto):
    """Aborted generations 0..upto that count against max_restarts: all but those whose
    container the resource manager stopped (preemption, node decommission...)."""
    n = 0
    for g in range(upto + 1):
        v = store.get(keys.abort(g))
        if v is not None and not json.loads(v).get("external"):
            n += 1
    return n


def log_tail(path, lines=20):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Agent:
    def __init__(self, ident, store):
        self.ident = ident
        self.store = store
        self.job = ident.job
        self.incarnation = uuid.uuid4().hex[:12]
        self.child = None
        self.heartbeat = os.path.abspath(f".heartbeat.{ident.container}")
        self.log_path = os.environ.get("YARNAPP_LOG", "")
        self.members = ident.job.ranks()
        self.cgroup = memory.own_cgroup()          # to tell a memory kill from any SIGKILL
        self.group_index = next(i for i, g in enumerate(ident.job.groups) if g.name == ident.group)

    # -- the rank process -------------------------------------------------
    def spawn(self, gen):
        threads = str(max(1, math.ceil(self.ident.rank_info()["vcores"])))
        # The working directory holds the user's shipped code (yarnapp.shipping): importable.
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, YARNAPP_RANK=str(self.ident.rank), YARNAPP_WORLD_SIZE=str(self.ident.world_size),
                   YARNAPP_GENERATION=str(gen), YARNAPP_INCARNATION=self.incarnation,
                   OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONPATH=path)
        try:
            os.unlink(self.heartbeat)
        except FileNotFoundError:
            pass
        self.memory_before = memory.state(self.cgroup)
        self.child = subprocess.Popen([sys.executable, "-m", "launcher.rank", "--generation", str(gen),
                                       "--heartbeat", self.heartbeat], env=env, preexec_fn=die_with_parent)
        self.spawned = time.monotonic()
        self._phase = "setup"

    def kill_child(self):
        if self.child and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    # -- watching -----------------------------------------------------------
    def observe(self, gen):
        """Everything monitor needs from the store for one poll, in ONE store call whatever
        the world's size: the generation's keys, who is alive, who is done, and FAILED."""
        return self.store.snapshot(prefixes=(f"{keys.ABORT_PREFIX}{gen:04d}/", "alive/", "done/"),
                                   keys=(keys.FAILED,))

    def lost_member(self, gen, seen):
        """A member that joined this generation whose container is gone or replaced
        (`seen`: a snapshot from observe)."""
        for m in self.members:
            if m["rank"] == self.ident.rank:
                continue
            joined = keys.joined(gen, m["rank"]) if m["rank"] else keys.port(gen)
            if joined not in seen or keys.done(m["container"]) in seen:
                continue
            a = seen.get(keys.alive(m["container"]))
            if a is None:
                return m["container"], "its container exited"
            inc = seen.get(keys.incarnation(gen, m["rank"]))
            if json.loads(a)["incarnation"] != (inc.decode() if inc else None):
                return m["container"], "its container was replaced"
        return None

    def someone_else_failed(self, gen, grace=1.0):
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            seen = self.observe(gen)
            if keys.abort(gen) in seen or self.lost_member(gen, seen):
                return keys.abort(gen) in seen
            time.sleep(0.05)
        return False

    def read_heartbeat(self, now):
        """(phase, seconds since the rank's last heartbeat)."""
        try:
            with open(self.heartbeat) as f:
                words = f.read().split()
            age = time.time() - os.path.getmtime(self.heartbeat)
        except FileNotFoundError:
            return "setup", now - self.spawned
        if not words:            # caught between the rank's truncate and write: it is beating now
            return self._phase, age
        self._phase = words[0]
        return words[0], age

    def monitor(self, gen):
        """Watch one generation; return ("succeeded"|"own"|"other", reason dict)."""
        lj = self.job.launcher
        self.store.put(keys.incarnation(gen, self.ident.rank), self.incarnation)
        while True:
            rc = self.child.poll()
            if rc == 0:
                return "succeeded", None
            if rc is not None and rc != -signal.SIGKILL and self.someone_else_failed(gen):
                # A rank that lost a peer dies of MPI's fatal error (SIGABRT or an error
                # exit) moments after the peer: the peer's agent names the root cause.
                return "other", None
            if rc is not None:
                what = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
                oom = memory.killed_for_memory(self.memory_before, memory.state(self.cgroup),
                                               self.ident.container, self.group_index)
                if oom:
                    what = f"was killed by the kernel: {oom}"
                err = self.rank_error(gen, self.ident.rank) or {}
                line = f": {err['error']}" if err.get("error") else ""
                return "own", {"container": self.ident.container, "rank": self.ident.rank,
                               "exit_code": rc, "error": err.get("error"), "phase": err.get("phase"),
                               "reason": f"rank {self.ident.rank} ({self.ident.container}) {what}{line}"
                                         + self.network_note()}
            seen = self.observe(gen)
            if keys.FAILED in seen:
                return "other", None
            abort = seen.get(keys.abort(gen))
            if abort is not None:
                if json.loads(abort).get("phase") == "setup" and self.read_heartbeat(time.monotonic())[0] == "setup":
                    self.let_fail(SETUP_GRACE_S)   # will it fail the same way? (see deterministic)
                return "other", None
            formed = keys.formed(gen) in seen
            now = time.monotonic()
            if not formed and now - self.spawned > lj.rendezvous_timeout:
                missing = [m["container"] for m in self.members
                           if m["rank"] and keys.joined(gen, m["rank"]) not in seen]
                nodes = network.members_from(self.store)
                missing = [f"{c} on {nodes[c]['node']} ({nodes[c]['addr']})" if c in nodes else c for c in missing]
                return "own", {"container": self.ident.container, "rank": self.ident.rank, "exit_code": None,
                               "reason": f"world not formed within {lj.rendezvous_timeout:.0f}s; "
                                         f"missing: {', '.join(missing) or 'none'}" + self.network_note()}
            if formed:
                phase, silent = self.read_heartbeat(now)
                limit = lj.heartbeat_timeout if phase == "train" else lj.rendezvous_timeout
                stopped = process_state(self.child.pid) in ("T", "t")
                # When one rank stops, the others soon block in a collective waiting for it
                # and go silent too: a rank that is merely waiting gives the stopped one's
                # agent a grace period to name the real culprit first.
                if silent > limit + (0 if stopped else min(2.0, limit / 2)):
                    return "own", {"container": self.ident.container, "rank": self.ident.rank, "exit_code": None,
                                   "reason": f"rank {self.ident.rank} ({self.ident.container}) hung"
                                             f"{' (process stopped)' if stopped else ''}: "
                                             f"no progress for {silent:.1f}s in {phase} (limit {limit:g}s: "
                                             f"launcher.{'heartbeat' if phase == 'train' else 'rendezvous'}"
                                             f"_timeout)" + self.network_note()}
            lost = self.lost_member(gen, seen)
            if lost:
                return "own", {"container": lost[0], "rank": None, "exit_code": None,
                               "reason": f"lost {lost[0]}: {lost[1]}", "observed_by": self.ident.container}
            time.sleep(lj.poll_interval)

    def rank_error(self, gen, rank):
        """The error record a rank left for generation `gen` (launcher.rank), or None."""
        v = self.store.get(keys.error(gen, rank))
        return json.loads(v) if v else None

    def let_fail(self, seconds):
        """Give the rank, still in setup, up to `seconds` to end on its own."""
        deadline = time.monotonic() + seconds
        while self.child.poll() is None and time.monotonic() < deadline:
            time.sleep(self.job.launcher.poll_interval)

    def deterministic(self, gen, cause):
        """Whether generation `gen` failed in a way a restart would repeat: every rank failed
        before its first training step with the same error line. Waits (bounded) until every
        rank's agent has recorded how its rank ended."""
        if cause.get("phase") != "setup" or not cause.get("error"):
            return False
        deadline = time.monotonic() + SETUP_GRACE_S + 5
        while True:
            records = [self.rank_error(gen, m["rank"]) for m in self.members]
            if all(records) or time.monotonic() > deadline:
                break
            time.sleep(self.job.launcher.poll_interval)
        return all(r and r.get("phase") == "setup" and r.get("error") == cause["error"] for r in records)

    def network_note(self):
        """On emulated nodes: "; <which node is unreachable>" when the world hangs or cannot
        form because of the network (empty otherwise, and always on a shared host)."""
        members = network.members_from(self.store)
        why = network.diagnose(members, self.ident.container) if members else ""
        return f"; network: {why}" if why else ""

    # -- the state machine --------------------------------------------------
    def run(self):
        self.store.put(keys.alive(self.ident.container),
                       json.dumps({"incarnation": self.incarnation, "pid": os.getpid(), "time": time.time()}),
                       owned=True)
        gen = current_generation(self.store)
        while True:
            if self.store.get(keys.FAILED) is not None:
                log.error("application already failed; not starting a rank")
                return EXIT_APP_FAILED
            log.info("RENDEZVOUS generation %d as rank %d of %d", gen, self.ident.rank, self.ident.world_size)
            self.spawn(gen)
            outcome, reason = self.monitor(gen)
            if outcome == "succeeded":
                self.store.put(keys.done(self.ident.container), json.dumps({"generation": gen}))
                log.info("SUCCEEDED")
                return 0
            self.kill_child()
            # How this rank ended, for `deterministic` (its own error record, if it left one, wins).
            self.store.put_if_absent(keys.error(gen, self.ident.rank), json.dumps({"error": None}))
            if reason:
                reason.update(generation=gen, time=time.time(), log=self.log_path,
                              log_tail=log_tail(self.log_path) if reason.get("rank") == self.ident.rank else "")
                if self.store.put_if_absent(keys.abort(gen), json.dumps(reason)):
                    log.error("generation %d aborted: %s", gen, reason["reason"])
            cause = json.loads(self.store.get(keys.abort(gen)) or b"{}")
            final = self.store.get(keys.FAILED) is not None
            if not final and self.deterministic(gen, cause):
                self.store.put_if_absent(keys.FAILED, json.dumps({
                    **cause, "attempts": gen + 1, "retried": False,
                    "reason": f"{cause.get('reason')}; {NOT_RETRIED}"}))
            if self.store.get(keys.FAILED) is not None or spent_restarts(self.store, gen) > self.job.max_restarts:
                first = json.loads(self.store.get(keys.abort(0)) or b"{}") or cause
                first["attempts"] = gen + 1
                self.store.put_if_absent(keys.FAILED, json.dumps(first))
                log.error("FAILED after %d attempt(s): %s", gen + 1, first.get("reason"))
                return EXIT_APP_FAILED if reason is None or reason.get("rank") != self.ident.rank \
                    else (reason.get("exit_code") or 1) if (reason.get("exit_code") or 0) > 0 else 1
            gen += 1
            self.store.put_if_absent(keys.restart(gen), json.dumps({**cause, "aborted_generation": gen - 1,
                                                                    "generation": gen}))
            log.warning("RESTARTING as generation %d after: %s", gen, cause.get("reason"))


def main():
    ident = identity.from_env()
    store = store_mod.from_env()
    if ident.rank < 0:
        ident = ident.adopt(store)
        os.environ["YARNAPP_CONTAINER_ID"] = ident.container   # the rank process takes this slot
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s agent {ident.container} %(levelname)s: %(message)s")
    agent = Agent(ident, store)

    def on_term(signum, frame):
        # The resource manager stops a container with SIGTERM (preemption, decommission,
        # `yarnapp kill`): say so, so that this generation's end does not spend the budget.
        agent.kill_child()
        try:
            gen = current_generation(agent.store)
            agent.store.put_if_absent(keys.abort(gen), json.dumps({
                "container": ident.container, "rank": ident.rank, "exit_code": None, "external": True,
                "generation": gen, "time": time.time(),
                "reason": f"container {ident.container} was stopped by the resource manager (SIGTERM)"}))
        finally:
            os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    code = agent.run()
    results.publish_end(ident, store, code)     # YARN: what outlives the application
    logging.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
