"""The container agent: the main process of every container, on both engines.

It is a loop around an explicit state machine (`State`, as torchrun's agent): it starts
one rank process per generation of the world (launcher.rank), watches it and the store
(launcher.monitor), and ends the generation everywhere when anything goes wrong, so that
a rank never hangs forever inside a collective. START publishes `alive/<container>`
(owned: the resource manager deletes it when the container exits), starts the
container's beat and finds the current generation (the first without an abort record). A
peer whose beat stops (launcher.beats) ends the generation too, and is replaced through
the resource manager. Why a generation ended is one `launcher.failure.Failure`; when the
cause is a peer (lost, frozen, missing, or the one this rank died of),
`launcher.diagnosis` finds it. The container's exit status is decided in
`launcher.exitcodes`.
"""
import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid

from conf import BUILTIN_RUNNER

from . import beats, exitcodes, identity, keys, memory, results, retries, store as store_mod, warm, zygote
from .diagnosis import PeerDiagnosis, record
from .activity import Activity
from .monitor import SETUP_GRACE_S, Monitor, Outcome
from .procs import die_with_parent, stopped as process_stopped
from .failure import Failure, Kind, after_an_end, current_generation, ended_early, log_tail, looks_collateral, spent_restarts

log = logging.getLogger("launcher.agent")

TERM_GRACE_S = 2.0       # a rank stopped with SIGTERM may end on its own this long (the local master waits 3 s)
RANK_END_WAIT_S = 0.12   # at a NodeManager's SIGTERM, for its rank's own peak (its SIGKILL follows in 250 ms;
                         # a rank of 900 MiB took 45 ms to end, unloaded; the record is written after)
VERDICT_WAIT_S = 10      # for skein's master to hear how YARN ended a container (yarn_verdict)


class State(enum.Enum):
    """The agent's states. Transitions (Agent.step; each one is logged):

        START       → RENDEZVOUS    the application has not failed: generation = the first
                                    without an abort record
                    → FAILED        it already failed (a replacement container came late)
        RENDEZVOUS  → RUNNING       the rank process is started; it joins world `gen`
        RUNNING     → SUCCEEDED     the rank exited 0
                    → RESTARTING    the generation ended: this agent found why (its rank
                                    crashed, was killed for memory or hung; the world did
                                    not form; a member's container was lost) and wrote the
                                    abort record, or another agent / the master did
        RESTARTING  → RENDEZVOUS    the rank is killed; restarts left: generation + 1
                    → FAILED        the application failed elsewhere, the restarts are
                                    spent (external ends spend none), or every rank failed
                                    the same way before training (a restart would too)
        SUCCEEDED, FAILED           final: the container exits (launcher.exitcodes)
    """
    START = "start"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# The transitions drawn above, the only ones Agent.run takes (a test holds the two together).
TRANSITIONS = {
    State.START: {State.RENDEZVOUS, State.FAILED},
    State.RENDEZVOUS: {State.RUNNING},
    State.RUNNING: {State.SUCCEEDED, State.RESTARTING},
    State.RESTARTING: {State.RENDEZVOUS, State.FAILED},
    State.SUCCEEDED: set(),
    State.FAILED: set(),
}


class Agent(Monitor, PeerDiagnosis):
    def __init__(self, ident, store):
        self.ident = ident
        self.store = store
        self.job = ident.job
        self.own_code = ident.job.run.function != BUILTIN_RUNNER      # not the built-in runner's loop
        self.incarnation = uuid.uuid4().hex[:12]
        self.child = None
        self.warm = None                 # launcher.warm: where this container's ranks are forked from
        self.zygote = zygote.Client.from_env() if ident.backend == "local" else None   # ... and those from
        self.heartbeat = os.path.abspath(f".heartbeat.{ident.container}")
        self._phase, self._seen = "setup", False
        self.rank_importing = self._joining = False     # launcher.diagnosis: importing
        self.activity = Activity()       # whether its silent rank is at work (launcher.activity)
        self.log_path = os.environ.get("YARNAPP_LOG") or _yarn_log(ident.group)
        self.members = ident.job.ranks()
        self.cgroup = memory.own_cgroup()          # to tell a memory kill from any SIGKILL
        self.held = memory.Held(os.getpid())       # ... and, on YARN, from any SIGTERM (sampled in monitor)
        self.group_index = next(i for i, g in enumerate(ident.job.groups) if g.name == ident.group)
        self.peers = beats.Watch(self.members, ident.container, ident.job.launcher.heartbeat_timeout)
        self.formed_seen = None          # when this agent first saw this generation's world formed

    # -- the rank process -------------------------------------------------
    def spawn(self, gen):
        env = warm.environment(os.environ, self.ident.job.groups[self.group_index].env, self.ident.rank_info(),
                               os.getcwd(), YARNAPP_RANK=str(self.ident.rank),
                               YARNAPP_WORLD_SIZE=str(self.ident.world_size), YARNAPP_GENERATION=str(gen),
                               YARNAPP_INCARNATION=self.incarnation)
        try:
            os.unlink(self.heartbeat)
        except FileNotFoundError:
            pass
        self.memory_before = memory.state(self.cgroup)
        self.log_start = _size(self.log_path)      # where this generation's output starts (native_crash)
        argv = [sys.executable, "-m", "launcher.rank", "--generation", str(gen), "--heartbeat", self.heartbeat]
        # On the local engine the rank is forked from the container's warm process (launcher.warm),
        # which did its imports once (or was forked from the application's zygote, launcher.zygote).
        # Not on YARN: the NodeManager's memory check adds up each process's resident memory,
        # pages they share counted in both (a second torch, ~0.5 GB).
        if self.ident.backend == "local" and not (self.warm and self.warm.failed):
            if self.warm is None or not self.warm.alive():
                if self.warm is not None:
                    if self.warm.zygote_failed:
                        self.zygote = None  # (gone, or refused: this container's own warm processes from now on)
                    self.warm.close()       # (its pipes)
                self.warm = warm.Warm(env, self.zygote)
            self.child = self.warm.spawn(gen, self.heartbeat, argv, env)
        else:
            self.child = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent)
        self.spawned = time.monotonic()
        self._phase, self._seen = "setup", False
        self.activity.reset()

    def kill_child(self):
        if self.child and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    def stop_child(self, grace, group_signalled=False):
        """SIGTERM (unless `group_signalled`: its process group got it with this agent, once),
        then SIGKILL after `grace` seconds: the user's code may end on its own first (a handler
        that saves, `finally` blocks), as under torchrun or a NodeManager's stop. A rank still
        importing in the warm process has no code of the user's running yet, and a stopped
        (frozen) one cannot run any: killed at once."""
        child = self.child
        pid = warm.started_pid(child)
        if child and pid and child.poll() is None and not process_stopped(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if not (group_signalled and os.getpgid(pid) == os.getpgrp()):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        self.kill_child()

    # -- watching -----------------------------------------------------------
    def fence(self):
        """This incarnation was judged frozen and is being replaced (it resumed in time to
        see so): its slot is another's now. Leave without a word."""
        log.error("this container was judged frozen and is being replaced; leaving")
        self.kill_child()
        logging.shutdown()
        os._exit(exitcodes.RANK_FAILED)

    # -- the state machine --------------------------------------------------
    def run(self):
        """Drive the states from START to SUCCEEDED or FAILED; the container's exit status."""
        self.store.put(keys.alive(self.ident.container),
                       json.dumps({"incarnation": self.incarnation, "pid": os.getpid(), "time": time.time()}),
                       owned=True)
        beating = beats.start(self.store, self.ident.container, {
            "incarnation": self.incarnation, "group": self.ident.group, "rank": self.ident.rank,
            "engine_id": os.environ.get("SKEIN_CONTAINER_ID") or self.ident.container},   # whom to kill on YARN
            extra=self.rank_quiet)
        self.state, self.gen, self.found = State.START, current_generation(self.store), None
        while self.state not in (State.SUCCEEDED, State.FAILED):
            before = self.state
            self.state = self.step(self.state)
            if self.state not in TRANSITIONS[before]:
                raise RuntimeError(f"no transition {before.name} -> {self.state.name} (launcher.agent.State)")
            log.info("%s -> %s (generation %d)", before.name, self.state.name, self.gen)
        beating.set()
        if self.state is State.SUCCEEDED:
            return exitcodes.SUCCEEDED
        return exitcodes.agent_status(self.found, self.ident.rank)

    def step(self, state):
        """One transition of `State` (see its docstring): the next state."""
        if state is State.START:
            if self.store.get(keys.FAILED) is not None:
                log.error("application already failed; not starting a rank")
                return State.FAILED
            return State.RENDEZVOUS
        if state is State.RENDEZVOUS:
            if self.store.get(keys.replace(self.ident.container, self.incarnation)) is not None:
                self.fence()
            log.info("generation %d as rank %d of %d", self.gen, self.ident.rank, self.ident.world_size)
            self.spawn(self.gen)
            return State.RUNNING
        if state is State.RUNNING:
            outcome, self.found = self.monitor(self.gen)
            if outcome is Outcome.SUCCEEDED:
                self.store.put(keys.done(self.ident.container), json.dumps({"generation": self.gen}))
                return State.SUCCEEDED
            # A peer failed: this rank's code gets SIGTERM and a moment to end on its own, as
            # torchrun gives its workers (it was SIGKILLed: a handler saving state on SIGTERM, and
            # `finally` blocks, never ran on the survivors). A rank found hung is killed at once.
            hung = self.found and self.found.kind == Kind.HUNG.value and self.found.rank == self.ident.rank
            self.kill_child() if hung else self.stop_child(TERM_GRACE_S)
            return State.RESTARTING
        if state is State.RESTARTING:
            return self.after_abort(self.gen, self.found)
        raise RuntimeError(f"no transition from {state.name}")

    def yarn_verdict(self, gen, cause):
        """A container YARN stopped whose agent said no more than that: the NodeManager stops
        one over its memory as it stops one it preempts (SIGTERM, SIGKILL 250 ms later), and
        its agent's record, which must be written within those 250 ms, missed the memory on a
        busy machine (one stop in four: its job was retried as if preempted). skein's master
        hears YARN's verdict within seconds: read for up to VERDICT_WAIT_S, and where it is a
        memory kill, the record says so (every agent reads it alike)."""
        group = cause.container.rpartition("_")[0]
        index = next((i for i, g in enumerate(self.job.groups) if g.name == group), None)
        if index is None:
            return cause
        since = (cause.time or time.time()) - 5        # (the one stopped before ended seconds earlier)
        deadline = time.monotonic() + VERDICT_WAIT_S
        while True:
            try:
                verdict = self.store.memory_kill(group, since)
            except Exception:  # noqa: BLE001 - skein's master out of reach: the record as it is
                log.exception("could not ask YARN how container %s ended", cause.container)
                return cause
            if verdict or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if not verdict:
            return cause
        used, words = verdict
        asked = self.job.groups[index].memory
        over = memory.stopped_for_memory(used, asked, index, memory.yarn_step_mib()) if used else None
        amended = dataclasses.replace(cause, kind=Kind.OOM.value, external=False,
                                      reason=f"rank {cause.rank} ({cause.container}) {over}" if over
                                      else f"rank {cause.rank} ({cause.container}) was stopped by YARN: {words}")
        self.store.put(keys.abort(gen), amended.dumps())
        log.warning("YARN says container %s was killed for its memory: %s", cause.container, words)
        return amended

    def after_abort(self, gen, found):
        """Generation `gen` ended (`found`: the cause this agent found, or None): record it
        (first writer wins, but for a record that says more: diagnosis.record), then FAILED,
        or RENDEZVOUS in the next generation."""
        # How this rank ended, for launcher.retries (its own error record, if it left one, wins).
        self.store.put_if_absent(keys.error(gen, self.ident.rank), Failure(
            reason="ended without an error line", rank=self.ident.rank, generation=gen).stamped().dumps())
        if found:
            own = found.rank == self.ident.rank and not found.observed_by
            early = ended_early(self.store, self.members, gen, self.ident.rank,
                                2 * self.job.launcher.poll_interval) \
                if own and found.kind == Kind.CRASHED.value and looks_collateral(found.reason) else None
            found = found.stamped(reason=after_an_end(early, found.reason)) if early else found
            # The log is this container's: only for a failure of its own (not one it observed); its
            # path only locally (on YARN it is on the node: `yarnapp logs` reads it).
            found = found.stamped(generation=gen, log=self.log_path if own and self.ident.backend == "local" else "",
                                  log_tail=log_tail(self.log_path) if own and not found.input_error else "")
            if record(self.store, keys.abort(gen), found):
                log.error("generation %d aborted: %s", gen, found.reason)
        cause = Failure.load(self.store.get(keys.abort(gen))) or Failure(reason="")
        if cause.external and cause.container and self.ident.backend == "yarn":
            cause = self.yarn_verdict(gen, cause)
        if self.store.get(keys.FAILED) is None:
            why = retries.not_worth_retrying(self.store, self.members, gen, cause,
                                             self.job.launcher.poll_interval, SETUP_GRACE_S + 5)
            if why:
                self.store.put_if_absent(keys.FAILED, dataclasses.replace(
                    cause, attempts=gen + 1, retried=False, reason=f"{cause.reason}; {why}").dumps())
        if self.store.get(keys.FAILED) is not None or spent_restarts(self.store, gen) > self.job.max_restarts:
            # The failure that spent the last restart (the earlier ones are the restarts' records).
            self.store.put_if_absent(keys.FAILED, dataclasses.replace(cause, attempts=gen + 1).dumps())
            log.error("FAILED after %d attempt(s): %s", gen + 1, cause.reason)
            return State.FAILED
        self.gen = gen + 1
        record(self.store, keys.restart(self.gen), dataclasses.replace(cause, aborted_generation=gen,
                                                                        generation=self.gen))
        log.warning("restarting as generation %d after: %s", self.gen, cause.reason)
        wait = retries.storage_backoff_s(self.store, gen)      # (a NameNode restarting: give it time)
        if wait:
            log.warning("a filesystem was out of reach: waiting %.0f s before the restart", wait)
            time.sleep(wait)
        return State.RENDEZVOUS


def main():
    ident = identity.from_env()
    store = store_mod.from_env()
    if ident.rank < 0:
        ident = ident.adopt(store)
        os.environ["YARNAPP_CONTAINER_ID"] = ident.container   # the rank process takes this slot
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s agent {ident.container} %(levelname)s: %(message)s")
    if results.ended_before(ident, store):      # YARN: a new master attempt of a failed application
        return exitcodes.RANK_FAILED
    agent = Agent(ident, store)

    def on_term(signum, frame):
        # The resource manager stops a container with SIGTERM (preemption, decommission,
        # `yarnapp kill`): say so, so that this generation's end does not spend the budget;
        # unless YARN's NodeManager stopped it for its memory (it stops those the same way).
        # Said first (YARN's NodeManager SIGKILLs 250 ms later), then the rank's own end.
        if stopping:        # (a second signal: the stop is under way, its handler not run again)
            return
        stopping.append(signum)
        try:
            # The store read first, the rank's end waited for after (replaced as frozen: its peers said why)
            replaced = agent.store.get(keys.replace(ident.container, agent.incarnation)) is not None
            gen = None if replaced else current_generation(agent.store)
            over = None
            if signum == signal.SIGTERM and ident.backend == "yarn":     # (the local engine's limit: its cgroup)
                try:
                    asked, step = agent.job.groups[agent.group_index].memory, memory.yarn_step_mib()
                    held = agent.held.at_stop(agent.child, RANK_END_WAIT_S, memory.allocated_mib(asked, step) * 2**20)
                    over = memory.stopped_for_memory(held, asked, agent.group_index, step)
                except Exception:  # noqa: BLE001 - the abort record below matters more than its words
                    log.exception("could not tell whether this container was over its memory")
            if not replaced:
                agent.store.put_if_absent(keys.abort(gen), (Failure(
                    kind=Kind.OOM.value, container=ident.container, rank=ident.rank, phase=agent._phase,
                    reason=f"rank {ident.rank} ({ident.container}) {over}") if over else Failure(
                    kind=Kind.EXTERNAL.value, container=ident.container, rank=ident.rank, external=True,
                    reason=f"container {ident.container} was stopped by the resource manager (SIGTERM)"
                    if ident.backend == "yarn" else f"container {ident.container} was sent SIGTERM from outside "
                    f"yarnapp")
                ).stamped(generation=gen).dumps())
        finally:
            agent.stop_child(TERM_GRACE_S, group_signalled=True)
            os._exit(exitcodes.signalled(signum))
    stopping = []
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    code = agent.run()
    results.publish_end(ident, store, code)     # YARN: what outlives the application
    logging.shutdown()
    return code


def _yarn_log(service):
    """This container's log on YARN, where skein sends the service's output
    ($LOG_DIRS/<service>.log), or ""."""
    path = os.path.join(os.environ.get("LOG_DIRS", "").split(",")[0], f"{service}.log")
    return path if os.environ.get("LOG_DIRS") and os.path.exists(path) else ""


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
