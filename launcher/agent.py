"""The container agent: the main process of every container, on both engines.

It is a loop around an explicit state machine (`State`, as torchrun's agent): it starts
one rank process per generation of the world (launcher.rank), watches it and the store,
and ends the generation everywhere when anything goes wrong, so that a rank never hangs
forever inside a collective. START publishes `alive/<container>` (owned: the resource
manager deletes it when the container exits), starts the container's beat and finds the
current generation (the first without an abort record). A peer whose beat stops
(launcher.beats) ends the generation too, and is replaced through the resource manager.
Why a generation ended is one `launcher.failure.Failure`; when the cause is a peer (lost,
frozen, missing, or the one this rank died of), `launcher.diagnosis` finds it. The
container's exit status is decided in `launcher.exitcodes`.
"""
import contextlib
import dataclasses
import enum
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import uuid

from conf import BUILTIN_RUNNER

from . import beats, exitcodes, identity, keys, malloc, memory, results, retries, stacks, store as store_mod, warm
from .diagnosis import PeerDiagnosis, record
from .activity import Activity
from .procs import die_with_parent, stopped as process_stopped
from .failure import (Failure, Kind, after_an_end, current_generation, ended_early, log_tail,
                      looks_collateral, native_crash, spent_restarts)

log = logging.getLogger("launcher.agent")

TERM_GRACE_S = 2.0       # a rank stopped with SIGTERM may end on its own this long (the local master waits 3 s)
SETUP_GRACE_S = 8.0      # after a peer failed in setup, how long a rank in setup may take to fail
                         # the same way on its own (ranks start seconds apart on a busy host)
BUSY_HINT = (", idle (no CPU used): if it waits there on something slow (a read, a lock), call ctx.heartbeat() "
             "(training.dist.context().heartbeat()) in that wait, or raise launcher.heartbeat_timeout")
BUSY_LIMIT = 10             # a silent rank of own code at work (launcher.activity): hung after this many
                            # heartbeat_timeouts of it
BUSY_WORDS = (", at work (CPU) all that time, more than {n} times launcher.heartbeat_timeout without progress: report "
              "progress in long work (training.dist.report, ctx.heartbeat()), or raise launcher.heartbeat_timeout")
EARLY_END_FRACTION = 0.25   # a rank still in a collective this part of launcher.heartbeat_timeout (15 s of
                            # the default 60 s) after a peer's code finished waits for it (code on
                            # torch.distributed fails sooner: the ended rank's sockets close after
                            # launcher.rank.FINISH_WAIT_FRACTION of it)


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


class Outcome(enum.Enum):
    """How a generation ended, as `Agent.monitor` saw it."""
    SUCCEEDED = "succeeded"   # the own rank exited 0
    OWN = "own"               # this agent found the cause (monitor returns the Failure)
    OTHER = "other"           # another agent or the master did (an abort record, or FAILED)


class Agent(PeerDiagnosis):
    def __init__(self, ident, store):
        self.ident = ident
        self.store = store
        self.job = ident.job
        self.own_code = ident.job.run.function != BUILTIN_RUNNER      # not the built-in runner's loop
        self.incarnation = uuid.uuid4().hex[:12]
        self.child = None
        self.warm = None                 # launcher.warm: where this container's ranks are forked from
        self.heartbeat = os.path.abspath(f".heartbeat.{ident.container}")
        self._phase, self._seen = "setup", False
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
        threads = str(max(1, math.ceil(self.ident.rank_info()["vcores"])))
        # The working directory holds the user's shipped code (yarnapp.shipping): importable.
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        env = malloc.environment(dict(os.environ, YARNAPP_RANK=str(self.ident.rank),
                                      YARNAPP_WORLD_SIZE=str(self.ident.world_size),
                                      YARNAPP_GENERATION=str(gen), YARNAPP_INCARNATION=self.incarnation,
                                      OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONPATH=path))
        try:
            os.unlink(self.heartbeat)
        except FileNotFoundError:
            pass
        self.memory_before = memory.state(self.cgroup)
        self.log_start = _size(self.log_path)      # where this generation's output starts (native_crash)
        argv = [sys.executable, "-m", "launcher.rank", "--generation", str(gen), "--heartbeat", self.heartbeat]
        # On the local engine the rank is forked from the container's warm process (launcher.warm),
        # which did its imports once. Not on YARN: the NodeManager's memory check adds up each
        # process's resident memory, pages they share counted in both (a second torch, ~0.5 GB).
        if self.ident.backend == "local" and not (self.warm and self.warm.failed):
            if self.warm is None or not self.warm.alive():
                self.warm = warm.Warm(env)
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
        pid = child.pid if isinstance(child, subprocess.Popen) else getattr(child, "started_pid", None)
        if child and pid and child.poll() is None and not process_stopped(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if not (group_signalled and os.getpgid(pid) == os.getpgrp()):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        self.kill_child()

    # -- watching -----------------------------------------------------------
    def observe(self, gen):
        """Everything monitor needs from the store for one poll, in ONE store call whatever
        the world's size: the generation's keys, who is alive, beating, done or being
        replaced, and FAILED."""
        return self.store.snapshot(prefixes=(f"{keys.ABORT_PREFIX}{gen:04d}/", "alive/", "done/", keys.BEAT_PREFIX,
                                             keys.REPLACE_PREFIX),
                                   keys=(keys.FAILED,))

    def fence(self):
        """This incarnation was judged frozen and is being replaced (it resumed in time to
        see so): its slot is another's now. Leave without a word."""
        log.error("this container was judged frozen and is being replaced; leaving")
        self.kill_child()
        logging.shutdown()
        os._exit(exitcodes.RANK_FAILED)

    def rank_quiet(self):
        """For this agent's beat: {"rank_quiet": seconds since its rank last beat}, while the
        rank trains (peers found waiting defer to a rank that beat after them: stacks)."""
        try:
            if self.child is None or self.child.returncode is not None or self._phase != "train":
                return {}
            return {"rank_quiet": round(max(0.0, time.time() - os.path.getmtime(self.heartbeat)), 2),
                    **({"rank_busy": True} if self.activity.busy else {})}
        except (OSError, AttributeError):
            return {}

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
        self._seen = words[-1] == "seen"        # only its optimizer's steps were seen (RunContext.heartbeat)
        return words[0], age

    def monitor(self, gen):
        """Watch one generation until it ends: (Outcome, the Failure this agent found or None)."""
        lj = self.job.launcher
        self.store.put(keys.incarnation(gen, self.ident.rank), self.incarnation)
        me, rank = self.ident.container, self.ident.rank
        self.formed_seen = None
        waited = 0.0            # extra silence allowed a rank found waiting for its peers (launcher.stacks)
        peer_ended = None       # when this agent first saw a peer's code finished (and its rank not)
        while True:
            rc = self.child.poll()
            if rc == 0:
                return Outcome.SUCCEEDED, None
            if rc is not None and rc != -signal.SIGKILL:
                # Collateral or cause? A rank that raised its own error (not a lost
                # connection) is the cause. Otherwise, once the world has formed, wait for a
                # dead peer: the resource manager reports a dead container late (YARN:
                # seconds), and a dead rank's agent within its poll. A lost connection waits
                # a poll longer still, so that a rank that died first, without a word (its
                # agent waits too), is named, not the ranks it took with it.
                record = self.rank_error(gen, rank) or Failure(reason="")
                said = record.error
                # (a line every rank raised alike, at another rank's fault: that rank's agent names it)
                collateral = bool(said) and (looks_collateral(said) or record.blames not in (None, rank))
                grace = 1.0
                if (collateral or not said) and keys.formed(gen) in self.observe(gen):
                    grace = self.store.death_notice_s + lj.poll_interval + (lj.poll_interval + 0.5) * collateral
                cause = self.peer_cause(gen, grace)
                if cause is True:
                    return Outcome.OTHER, None
                if cause is not None:
                    return Outcome.OWN, cause
            if rc is not None:
                what, kind = exitcodes.describe(rc)[0], Kind.CRASHED
                oom = memory.killed_for_memory(self.memory_before, memory.state(self.cgroup), me, self.group_index)
                if oom:
                    what, kind = f"was killed by the kernel: {oom}", Kind.OOM
                err = self.rank_error(gen, rank) or Failure(reason="")
                if rc < 0 and not err.error and kind is Kind.CRASHED:
                    err.error = native_crash(self.log_path, self.log_start)     # a C++ abort: its what()
                line = f": {err.error}" if err.error and err.error != what else ""     # sys.exit(3) says no more
                return Outcome.OWN, Failure(kind=kind.value, container=me, rank=rank, exit_code=rc,
                                            error=err.error, phase=err.phase, input_error=err.input_error,
                                            repeats=err.repeats, certain=err.certain,
                                            reason=f"rank {rank} ({me}) {what}{line}" + self.network_note())
            if self.ident.backend == "yarn":
                self.held.sample()
            seen = self.observe(gen)
            if self.formed_seen is None and keys.formed(gen) in seen:
                self.formed_seen = time.monotonic()
                if rank == 0 and gen >= 2:      # every agent has left generation gen - 2 (keys.spent)
                    self.store.delete_prefixes(keys.spent(gen - 2))
            if keys.FAILED in seen:
                return Outcome.OTHER, None
            abort = Failure.load(seen.get(keys.abort(gen)))
            if abort is not None:
                if abort.phase == "setup" and self.read_heartbeat(time.monotonic())[0] == "setup":
                    self.let_fail(self.setup_grace())   # will it fail the same way? (see launcher.retries)
                return Outcome.OTHER, None
            now = time.monotonic()
            if keys.replace(me, self.incarnation) in seen:
                self.fence()
            frozen = self.peers.frozen(seen, now)
            if frozen:
                return Outcome.OWN, self.replace_frozen(gen, seen, frozen)
            formed = keys.formed(gen) in seen
            if not formed and now - self.spawned > lj.rendezvous_timeout:
                return Outcome.OWN, self.not_formed(gen, seen)
            apart = self.called_apart(gen, seen) if formed else None
            if apart:
                return Outcome.OWN, apart
            if formed:
                phase, silent = self.read_heartbeat(now)
                stopped = process_stopped(self.child.pid)
                gone = self.finished_peers(gen, seen) if phase != "finished" and not stopped else []
                peer_ended = (peer_ended or now) if gone else None
                early_end = EARLY_END_FRACTION * lj.heartbeat_timeout
                if gone and now - peer_ended >= early_end:
                    # Its liveness thread keeps own code that never reported progress alive, so
                    # a rank left in a collective by a peer that ended early would wait forever.
                    # Only where every unfinished rank waits: one may wait for a slow peer.
                    at = stacks.where(stacks.dump(self.child.pid, self.heartbeat + stacks.SUFFIX))
                    self.store.put(keys.waiting(gen, rank), str(time.time()) if at and at.waiting else "0")
                    if at and at.waiting and self.all_waiting(gen, seen, early_end + 5.0):
                        return Outcome.OWN, self.waited_for_finished(now - peer_ended, gone, at.caller or at.frame)
                    # busy, or a peer not found waiting (yet): looked at again soon, or a period later
                    peer_ended = now - (max(0.0, early_end - 2.0) if at and at.waiting else 0.0)
                # a stopped process is not setting up: heartbeat_timeout, in any phase
                which = "heartbeat" if phase == "train" or (stopped and phase != "finished") else "rendezvous"
                limit = lj.heartbeat_timeout if which == "heartbeat" else lj.rendezvous_timeout
                judged_idle = self._seen and phase == "train" and not stopped   # an unmodified script's rank
                if judged_idle:
                    which, limit = "idle", lj.idle_timeout
                if phase == "finished":     # waits for its peers: theirs the judgement, this one a backstop
                    limit = max(lj.heartbeat_timeout, lj.rendezvous_timeout)
                # the job's own code at work past its limit (one rank evaluating, saving) is not hung
                judged_busy = phase == "train" and not stopped and (judged_idle or self.own_code)
                if judged_busy and silent > limit / 2:     # sampled from half the limit on: the window it judges
                    waiting = self.own_code and bool(json.loads(seen.get(keys.stall(gen, rank)) or "{}").get("name"))
                    self.activity.sample(self.child.pid, now, limit, waiting)
                elif self.activity.known:           # stepping again (or stopped, or past training)
                    self.activity.reset()
                # When one rank stops, the others soon block in a collective waiting for it
                # and go silent too: a rank that is merely waiting gives the stopped one's
                # agent a grace period to name the real culprit first.
                if silent > limit + (0 if stopped else min(2.0, limit / 2)) + waited:
                    # the job's own code at work, or idle waiting for a peer's that is (an evaluation
                    # on rank 0 alone): not hung; training.dist's, for BUSY_LIMIT heartbeat_timeouts
                    capped = self.own_code and not judged_idle and silent > BUSY_LIMIT * limit
                    at_work = judged_busy and not capped and self.activity.busy     # (sampled above, this look)
                    if at_work and not judged_idle and self.activity.in_a_wait(
                            self.child.pid, self.heartbeat + stacks.SUFFIX, now, limit):
                        at_work = False
                    if judged_busy and not capped and (at_work or self.peers.busy()):
                        time.sleep(lj.poll_interval)
                        continue
                    # ... or a peer whose whole container stopped, whose agent cannot say so.
                    suspects = [] if stopped else self.peers.silent(now, beats.SUSPECT_S)
                    if suspects:
                        return Outcome.OWN, self.replace_frozen(gen, seen, suspects)
                    if waited and self.judged_later(silent, limit, now) and not self.lost_member(gen, seen):
                        time.sleep(lj.poll_interval)       # found waiting: its peer's agent names that one
                        continue
                    if phase == "finished":     # its code ended: not hung while a peer still makes progress
                        if any(q < lj.heartbeat_timeout for q in self.peers.rank_quiet(now).values()):
                            time.sleep(lj.poll_interval)
                            continue
                        return Outcome.OWN, Failure(kind=Kind.HUNG.value, container=me, rank=rank, reason=(
                            f"rank {rank} ({me}) finished its code {silent:.0f}s ago, and its peers have made no "
                            f"progress since (limit {limit:g}s: the larger of launcher.heartbeat_timeout and "
                            f"rendezvous_timeout): one waiting in a collective for it may have run more steps; "
                            f"every rank must run the same steps"))
                    at = None if stopped else stacks.where(stacks.dump(self.child.pid, self.heartbeat + stacks.SUFFIX),
                                                            idle=judged_idle)
                    if at and at.waiting and not waited:    # the rank it waits for is named first
                        waited = min(limit, stacks.WAITING_GRACE_S)
                        continue
                    if at and not at.waiting and judged_busy and not judged_idle and not capped \
                            and self.activity.cpu_busy:
                        self.activity.at_work_after_all(now)
                        continue
                    gone = self.finished_peers(gen, seen) if at and at.waiting else []
                    if gone:        # it waits in a collective for ranks whose code has ended
                        return Outcome.OWN, self.waited_for_finished(silent, gone)
                    return Outcome.OWN, Failure(
                        kind=Kind.HUNG.value, container=me, rank=rank,
                        reason=f"rank {rank} ({me}) hung{' (process stopped)' if stopped else ''}: "
                               f"no progress for {silent:.1f}s {self.phase_words(phase)} (limit {limit:g}s: "
                               f"launcher.{which}_timeout)"
                               + (f"; its main thread is at {at.describe()}"
                                  f"{', waiting for its peers' if at.waiting else ''}" if at else "")
                               + (" and idle (no optimizer step, no CPU used since)" if self._seen else
                                  (BUSY_WORDS.format(n=BUSY_LIMIT) if capped and self.activity.busy else BUSY_HINT)
                                  if at and not at.waiting and phase == "train" and self.own_code else "")
                               + self.network_note())
            lost = self.lost_member(gen, seen)
            if lost:
                return Outcome.OWN, Failure(kind=Kind.LOST.value, container=lost[0], observed_by=me,
                                            reason=f"lost {lost[0]}: {lost[1]}")
            time.sleep(lj.poll_interval)

    def phase_words(self, phase):
        """"in train", "in setup"; own code's setup is its time before its first progress
        report (training.dist.report, ctx.report), which is its own code running."""
        if phase == "setup" and self.own_code:
            return "before its first progress report"
        return f"in {phase}"

    def rank_error(self, gen, rank):
        """The Failure a rank left for generation `gen` (launcher.rank: its error line and
        phase; or its agent's record that it ended without one), or None."""
        return Failure.load(self.store.get(keys.error(gen, rank)))

    def setup_grace(self):
        """How long this rank, still in setup when a peer failed there, may take to fail the
        same way. Before the world formed, ranks start seconds apart (SETUP_GRACE_S); after,
        the join lined them up, so a rank that would fail as the peer did does so within a
        few times the time from the world's forming to the abort (the peer's own time, its
        agent's checks and grace): as many times as this rank's container has fewer vcores
        than the job's largest, and at least three, plus a second; at most SETUP_GRACE_S.
        Misjudged, the cost is a restart."""
        if self.formed_seen is None:
            return SETUP_GRACE_S
        slower = max(3.0, max(g.vcores for g in self.job.groups) / self.job.groups[self.group_index].vcores)
        return min(SETUP_GRACE_S, 1.0 + slower * (time.monotonic() - self.formed_seen))

    def let_fail(self, seconds):
        """Give the rank, still in setup, up to `seconds` to end on its own."""
        deadline = time.monotonic() + seconds
        while self.child.poll() is None and time.monotonic() < deadline:
            time.sleep(self.job.launcher.poll_interval)

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
        # Said first: YARN's NodeManager SIGKILLs 250 ms later; then the rank's own end.
        if stopping:        # (a second signal: the stop is under way, its handler not run again)
            return
        stopping.append(signum)
        over = None
        if signum == signal.SIGTERM and ident.backend == "yarn":     # (the local engine's limit: its cgroup)
            try:
                over = memory.stopped_for_memory(agent.held.peak(), agent.job.groups[agent.group_index].memory,
                                                 agent.group_index, memory.yarn_step_mib())
            except Exception:  # noqa: BLE001 - the abort record below matters more than its words
                log.exception("could not tell whether this container was over its memory")
        try:
            if agent.store.get(keys.replace(ident.container, agent.incarnation)) is None:   # (replaced as
                gen = current_generation(agent.store)                                  # frozen: peers said why)
                agent.store.put_if_absent(keys.abort(gen), (Failure(
                    kind=Kind.OOM.value, container=ident.container, rank=ident.rank, phase=agent._phase,
                    reason=f"rank {ident.rank} ({ident.container}) {over}") if over else Failure(
                    kind=Kind.EXTERNAL.value, container=ident.container, rank=ident.rank, external=True,
                    reason=f"container {ident.container} was stopped by the resource manager (SIGTERM)")
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
