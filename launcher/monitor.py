"""Watching one generation of a container's rank until it ends (`Monitor.monitor`), mixed
into launcher.agent.Agent as launcher.diagnosis's `PeerDiagnosis` is.

Each poll reads the rank process, its heartbeat file (launcher.rank writes its phase and
beats), and one snapshot of the store (`observe`); between two, the agent waits on its
rank's end (`nap`), which it acts on at once. A generation ends when the rank exits
(`rank_ended`: zero, its own error, a crash, the kernel's memory kill, or collateral of a
peer's end), when another agent or the master recorded an abort, when a peer froze or was
lost, when the world did not form in time, or when the rank is judged hung: silent past
launcher.heartbeat_timeout (rendezvous_timeout in setup, idle_timeout for an unmodified
script's idle rank), unless it is found at work (launcher.activity: own code, or any rank's
setup, for up to launcher.diagnosis.IMPORTING_LIMIT of its limits) or waiting in a
collective for a peer whose own agent names that peer first (launcher.stacks).
"""
import enum
import json
import os
import signal
import time

from . import beats, exitcodes, keys, memory, stacks, warm
from .diagnosis import IMPORTING_LIMIT
from .failure import Failure, Kind, logged_error, looks_collateral, native_crash
from .procs import stopped as process_stopped, wait_exit

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


class Outcome(enum.Enum):
    """How a generation ended, as `Monitor.monitor` saw it."""
    SUCCEEDED = "succeeded"   # the own rank exited 0
    OWN = "own"               # this agent found the cause (monitor returns the Failure)
    OTHER = "other"           # another agent or the master did (an abort record, or FAILED)


class Monitor:
    """Mixed into launcher.agent.Agent: uses its ident, job, store, child, spawned, peers,
    activity, heartbeat, memory_before, log_path and log_start, and fence()."""

    def observe(self, gen):
        """Everything monitor needs from the store for one poll, in ONE store call whatever
        the world's size: the generation's keys, who is alive, beating, done or being
        replaced, and FAILED."""
        return self.store.snapshot(prefixes=(f"{keys.ABORT_PREFIX}{gen:04d}/", "alive/", "done/", keys.BEAT_PREFIX,
                                             keys.REPLACE_PREFIX),
                                   keys=(keys.FAILED,))

    def rank_quiet(self):
        """For this agent's beat: {"rank_quiet": seconds since its rank last beat}, while the
        rank trains (peers found waiting defer to a rank that beat after them: stacks)."""
        try:
            if self.child is None or self.child.returncode is not None:
                return {}
            if self._phase != "train":      # (its setup at work: peers waiting for it in a collective wait on)
                return {**({"rank_importing": True} if self.rank_importing else {}),
                        **({"rank_busy": True} if self._phase == "setup" and self.activity.busy else {})}
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
        self._joining = words[-1] == "joining"  # its code imported, it joins the world (launcher.rank)
        return words[0], age

    def monitor(self, gen):
        """Watch one generation until it ends: (Outcome, the Failure this agent found or None)."""
        lj = self.job.launcher
        self.store.put(keys.incarnation(gen, self.ident.rank), self.incarnation)
        me, rank = self.ident.container, self.ident.rank
        self.formed_seen = None
        self.rendezvous_from = self.spawned     # moved on while containers wait to start (starting)
        self.rank_importing = self._joining = False
        self._look_again = self._said_starting = self._rm_unasked = None
        waited = 0.0            # extra silence allowed a rank found waiting for its peers (launcher.stacks)
        peer_ended = None       # when this agent first saw a peer's code finished (and its rank not)
        while True:
            rc = self.child.poll()
            if rc is not None:
                return self.rank_ended(gen, rc)
            if self.ident.backend == "yarn":
                self.held.sample()
            seen = self.observe(gen)
            if self.formed_seen is None and keys.formed(gen) in seen:
                self.formed_seen = time.monotonic()
                self.activity.reset()           # (what importing sampled, perhaps of the warm process)
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
            self.rank_importing = not formed and self.importing(now)
            if not formed and now - self.rendezvous_from > lj.rendezvous_timeout and not self.starting(now) \
                    and not self.still_importing(now):
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
                # the job's own code at work past its limit (one rank evaluating, saving) is not hung, nor
                # is a rank at work in its setup (its imports on a busy host, reading its data), for
                # up to IMPORTING_LIMIT limits (launcher.diagnosis)
                judged_busy = not stopped and (phase == "setup" or phase == "train" and (judged_idle or self.own_code))
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
                    capped = (self.own_code or phase == "setup") and not judged_idle and \
                        silent > (IMPORTING_LIMIT if phase == "setup" else BUSY_LIMIT) * limit
                    at_work = judged_busy and not capped and self.activity.busy     # (sampled above, this look)
                    if at_work and not judged_idle and self.activity.in_a_wait(
                            self.child.pid, self.heartbeat + stacks.SUFFIX, now, limit):
                        at_work = False
                    if judged_busy and not capped and (at_work or self.peers.saying("rank_busy")):
                        self.nap(lj.poll_interval)
                        continue
                    # ... or a peer whose whole container stopped, whose agent cannot say so.
                    suspects = [] if stopped else self.peers.silent(now, beats.SUSPECT_S)
                    if suspects:
                        return Outcome.OWN, self.replace_frozen(gen, seen, suspects)
                    if waited and self.judged_later(silent, limit, now) and not self.lost_member(gen, seen):
                        self.nap(lj.poll_interval)       # found waiting: its peer's agent names that one
                        continue
                    if phase == "finished":     # its code ended: not hung while a peer still makes progress
                        if any(q < lj.heartbeat_timeout for q in self.peers.rank_quiet(now).values()):
                            self.nap(lj.poll_interval)
                            continue
                        return Outcome.OWN, Failure(kind=Kind.HUNG.value, container=me, rank=rank, reason=(
                            f"rank {rank} ({me}) finished its code {silent:.0f}s ago, and its peers have made no "
                            f"progress since (limit {limit:g}s: the larger of launcher.heartbeat_timeout and "
                            f"rendezvous_timeout): one waiting in a collective for it may have run more steps; "
                            f"every rank must run the same steps"))
                    at = None if stopped else stacks.where(stacks.dump(self.child.pid, self.heartbeat + stacks.SUFFIX),
                                                            idle=judged_idle)
                    if at and at.waiting and not waited:    # the rank it waits for is named first
                        waited = min(limit, stacks.WAITING_GRACE_S) * (2 if self.behind_a_cut() else 1)
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
            self.nap(lj.poll_interval)

    def nap(self, seconds):
        """Wait up to `seconds` for the next look, waking at once when the rank ends."""
        pids, fds = warm.waitable(self.child)
        wait_exit(pids, seconds, fds)

    def rank_ended(self, gen, rc):
        """The rank process exited with `rc`: (Outcome, the Failure this agent found or None)."""
        if rc == 0:
            return Outcome.SUCCEEDED, None
        lj, me, rank = self.job.launcher, self.ident.container, self.ident.rank
        if rc != -signal.SIGKILL:
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
        what, kind = exitcodes.describe(rc)[0], Kind.CRASHED
        oom = memory.killed_for_memory(self.memory_before, memory.state(self.cgroup), me, self.group_index)
        if oom:
            what, kind = f"was killed by the kernel: {oom}", Kind.OOM
        err = self.rank_error(gen, rank) or Failure(reason="")
        if rc < 0 and not err.error and kind is Kind.CRASHED:
            err.error = native_crash(self.log_path, self.log_start)     # a C++ abort: its what()
        elif rc == exitcodes.RANK_FAILED and not err.error:             # its line, where the store took none
            err.error = logged_error(self.log_path, self.log_start) or None
        line = f": {err.error}" if err.error and err.error != what else ""     # sys.exit(3) says no more
        return Outcome.OWN, Failure(kind=kind.value, container=me, rank=rank, exit_code=rc,
                                    error=err.error, phase=err.phase, input_error=err.input_error,
                                    repeats=err.repeats, certain=err.certain,
                                    reason=f"rank {rank} ({me}) {what}{line}" + self.network_note())

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
            self.nap(self.job.launcher.poll_interval)
