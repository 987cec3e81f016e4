"""Why a generation ended, when the cause is a peer: the container agent's diagnosis of
the others (launcher.agent's `Agent` takes these methods from `PeerDiagnosis`).

- a member whose container exited or was replaced (`lost_member`), or whose code already
  finished while this rank waits for it (`finished_peers`; once every unfinished rank was
  found waiting, `all_waiting`, this one fails naming them: `waited_for_finished`);
- a rank that died of its peer's death, not its own (`peer_cause`: wait a moment for the
  root cause to show);
- a frozen container, whose agent's beat stopped: the generation ends naming it and the
  resource manager is asked to replace it (`replace_frozen`, `ask_replacement`), unless
  this abort ends the application (`fails_with`);
- a world that did not form: who is missing, and which running container never reported
  (`not_formed`);
- ranks waiting in different calls of training.dist's collectives (`called_apart`);
- a rank found waiting in a collective defers to a peer whose rank beat after it
  (`judged_later`), and a hang or a missing member on emulated nodes names the unreachable
  node (`network_note`).

Each returns a `launcher.failure.Failure` (or what the caller needs to decide), and writes
to the store only through its first-writer-wins keys (launcher.keys).
"""
import json
import logging
import time

from . import beats, keys, network, stacks
from .failure import CALLED_APART, WAITED_FOR_FINISHED, Failure, Kind, spends_the_last_restart
from .warm import started_pid

log = logging.getLogger("launcher.agent")

APART_GRACE_S = 5.0     # called_apart waits this long for every rank to say where it waits
STARTING_LOOK_S = 5.0   # while the resource manager has containers of the job to start, how often
                        # an agent past its rendezvous limit asks it again (starting)
IMPORTING_WINDOW_S = 10.0   # a rank in its start that used CPU over this long is at work (importing)
IMPORTING_LIMIT = 3     # a world waits past its rendezvous limit for a rank at work in its start, at
                        # most this many limits (code that runs forever as it is imported)


UNHEARD = "never reported"     # not_formed's note on running containers whose agents never beat


def overload_note(load=None, cores=None):
    """"; this host was overloaded ...": a world not formed on a host whose run queue was over
    twice its cores (ten jobs submitted at once on two cores: their ranks' imports alone
    outlast the limit), else ""."""
    import os
    load = os.getloadavg()[0] if load is None else load
    cores = cores or os.cpu_count() or 1
    if load <= 2 * cores:
        return ""
    return (f"; this host was overloaded (load average {load:.1f} on {cores} cores), so its ranks started slowly: "
            f"run fewer jobs at once, or raise launcher.rendezvous_timeout")


def says_more(found, recorded):
    """Whether `found`, this agent's cause of a world that did not form, names containers
    that never reported where `recorded`, another agent's that came first, does not: the
    agents judge at their own rendezvous limits, and one whose limit came a moment later
    found the late container past the frozen limit and had it replaced; the abort and the
    restart records say so then, in place of the first. (The application's failure stays
    the first writer's: it may carry why it was not retried.)"""
    return (found is not None and recorded is not None and found.kind == recorded.kind == Kind.NOT_FORMED.value
            and UNHEARD in (found.reason or "") and UNHEARD not in (recorded.reason or ""))


def record(store, key, failure):
    """Put `failure` (a Failure) at `key` unless one is there already (first writer wins),
    or in place of one that says less (says_more). True where it was first."""
    if store.put_if_absent(key, failure.dumps()):
        return True
    if says_more(failure, Failure.load(store.get(key))):
        store.put(key, failure.dumps())
    return False


class PeerDiagnosis:
    """Mixed into launcher.agent.Agent: uses its ident, job, members, store, peers and
    observe(); `importing` its child, warm, activity and read_heartbeat() too."""

    apart_since = None      # when called_apart first found ranks in calls that never meet
    _look_again = None      # starting: when to ask the resource manager again
    _said_starting = None   # starting: the count of containers to start it last logged
    _rm_unasked = None      # starting: the resource manager could not be asked (judged as before)
    _said_importing = None  # still_importing: the containers it last logged
    _importer = None        # importing: the process whose CPU it samples

    def starting(self, now):
        """Whether the world, past the rendezvous limit (counted from when this agent spawned
        its rank), may wait on: the resource manager has yet to start some of the job's
        containers (YARN: a busy queue holds them, or a replacement is asked for), so the
        limit counts from the start of the last of them, not before; a full cluster makes a
        job wait, as it waits to be accepted, not fail. The local engine starts a job's
        containers together (its leases: ACCEPTED until all fit): never there."""
        if self._look_again is not None and now < self._look_again:
            return True
        try:
            waiting, last_start = self.store.starting(sorted({m["group"] for m in self.members}))
        except Exception as e:      # the resource manager unreachable: judged as before
            log.warning("could not ask the resource manager which containers it has yet to start: %s", e)
            self._rm_unasked = True
            return False
        if waiting:
            self._look_again = now + STARTING_LOOK_S
            if waiting != self._said_starting:
                log.info("the world waits for the resource manager to start %d more container(s) of the job "
                         "(a busy queue or cluster); launcher.rendezvous_timeout counts from their start", waiting)
            self._said_starting = waiting
            return True
        self._look_again = None
        if last_start is not None:      # the limit from the last start (on the master's clock: skein's)
            self.rendezvous_from = max(self.rendezvous_from, now - max(0.0, time.time() - last_start))
        return now - self.rendezvous_from <= self.job.launcher.rendezvous_timeout

    def importing(self, now):
        """Whether this agent's rank is at work in its start, before it joins the world:
        importing torch and its code takes tens of seconds on a busy host (a job's third
        container, started when another tenant's left, beside a loaded node's other ranks).
        In setup, not yet joining (launcher.rank says so in its heartbeat), and using CPU over
        the last IMPORTING_WINDOW_S (launcher.activity); looked at from half the rendezvous
        limit on. Said in this agent's beat (`rank_importing`) for its peers' agents."""
        if now - self.rendezvous_from <= self.job.launcher.rendezvous_timeout / 2 or self.child.poll() is not None:
            return False
        phase, _ = self.read_heartbeat(now)
        if phase != "setup" or self._joining:
            return False
        # the rank, or, not forked yet, the warm process that imports for it (never waited for)
        pid = started_pid(self.child) or (self.warm.importer if self.warm is not None else None)
        if pid != self._importer:           # forked now: its CPU counts from zero (not known yet: at work)
            self._importer = pid
            self.activity.reset()
        return pid is not None and self.activity.sample(pid, now, IMPORTING_WINDOW_S)

    def still_importing(self, now):
        """Whether the world, past its rendezvous limit, waits on for members at work in their
        start (importing: this agent's rank, or a peer's as its agent's beat says), up to
        IMPORTING_LIMIT times the limit. A member idle in its start (stuck on a read, a lock,
        a network that does not reach) or stuck joining fails the world at the limit as before."""
        if now - self.rendezvous_from > IMPORTING_LIMIT * self.job.launcher.rendezvous_timeout:
            return False
        who = self.importing_members()
        if who and who != self._said_importing:
            log.info("the world waits past launcher.rendezvous_timeout for %s, still at work importing its code "
                     "(a busy host), for up to %d times that limit", ", ".join(who), IMPORTING_LIMIT)
        self._said_importing = who
        return bool(who)

    def importing_members(self):
        return ([self.ident.container] if self.rank_importing else []) + self.peers.saying("rank_importing")

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

    def finished_peers(self, gen, seen):
        """The peers ("rank 1 (w_1)") whose code finished in generation `gen` (launcher.rank)."""
        return [f"rank {m['rank']} ({m['container']})" for m in self.members
                if m["rank"] != self.ident.rank and keys.finished(gen, m["rank"]) in seen]

    def all_waiting(self, gen, seen, within):
        """Whether every other rank whose code has not finished was found waiting in a
        collective within the last `within` seconds (keys.waiting, written by each one's agent;
        `seen`: this poll's snapshot, which holds the generation's keys). This agent's own rank
        was just found waiting."""
        fresh = time.time() - within
        for m in self.members:
            if m["rank"] == self.ident.rank or keys.finished(gen, m["rank"]) in seen:
                continue
            mark = seen.get(keys.waiting(gen, m["rank"]))
            if mark is None or float(mark) < fresh:
                return False
        return True

    def waited_for_finished(self, seconds, gone, where=None):
        """The failure of this rank, found waiting in a collective for `gone`, ranks whose
        code finished (launcher.retries does not retry it: every attempt runs the same steps)."""
        rank, me = self.ident.rank, self.ident.container
        return Failure(kind=Kind.HUNG.value, container=me, rank=rank, reason=(
            f"rank {rank} ({me}) waited {seconds:.0f}s in a collective{f' at {where}' if where else ''} for "
            f"{', '.join(gone)}, {WAITED_FOR_FINISHED}: {'it' if len(gone) == 1 else 'they'} ran fewer steps "
            f"than this rank; every rank must run the same steps"))

    def peer_cause(self, gen, grace):
        """After this rank died of something other than SIGKILL: was it collateral? A rank that
        loses a peer dies of MPI's fatal error (SIGABRT or an error exit) moments after it, so
        wait up to `grace` seconds for the root cause to show. True when another agent wrote
        the generation's abort record; a LOST Failure when a member's container is gone (its
        own agent died with it and cannot say so); None when nothing else went wrong."""
        deadline = time.monotonic() + grace
        while True:
            seen = self.observe(gen)
            if keys.abort(gen) in seen:
                return True
            lost = self.lost_member(gen, seen)
            if lost:
                return Failure(kind=Kind.LOST.value, container=lost[0], observed_by=self.ident.container,
                               reason=f"lost {lost[0]}: {lost[1]}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def fails_with(self, gen, seen):
        """Whether an abort of generation `gen` ends the application (it failed already, or
        this abort spends the last restart): then no replacement is asked for."""
        return keys.FAILED in seen or spends_the_last_restart(self.store, gen, self.job.max_restarts)

    def ask_replacement(self, request, record):
        """Ask the resource manager to replace record["engine_id"] of record["group"], once:
        the first writer of `request` (launcher.keys.replace) asks, and withdraws a request
        that fails, so that it is asked again."""
        if self.store.put_if_absent(request, json.dumps({"by": self.ident.container, **record})):
            instances = next(g.instances for g in self.job.groups if g.name == record["group"])
            try:
                self.store.replace_container(record["engine_id"], record["group"], instances)
            except Exception as e:
                self.store.delete(request)
                log.error("could not ask for %s's replacement (it will be asked again): %s", record["engine_id"], e)

    def replace_frozen(self, gen, seen, frozen):
        """End generation `gen` naming the frozen peer silent longest (the abort record first,
        so that nobody names what its replacement does next), and ask the resource manager
        to replace each of `frozen` ([(container, seconds silent, its last beat)]) whose
        incarnation nobody has asked for yet (launcher.keys.replace; a request that fails is
        withdrawn, so that it is asked again). Several frozen at once (a host with two
        containers) are replaced together, not one restart each."""
        (container, silent, _), others = frozen[0], [c for c, _, _ in frozen[1:]]
        last = self.fails_with(gen, seen)       # then nothing is replaced
        failure = Failure(kind=Kind.LOST.value, container=container, observed_by=self.ident.container,
                          reason=f"lost {container}: it stopped responding (its agent has been silent for "
                                 f"{silent:.1f}s, limit {self.peers.limit:g}s: launcher.heartbeat_timeout; the "
                                 f"container is frozen or the store cannot reach it)"
                                 + (f" (and {', '.join(others)}, silent too)" if others else "")
                                 + ("" if last else "; the resource manager is asked to replace it"))
        if self.store.put_if_absent(keys.abort(gen), failure.stamped(generation=gen).dumps()):
            log.error("generation %d aborted: %s", gen, failure.reason)
        for c, quiet, beat in ([] if last else frozen):
            self.ask_replacement(keys.replace(c, beat["incarnation"]), {"silent_s": round(quiet, 1), **beat})
        return failure

    def not_formed(self, gen, seen):
        """The world did not form within launcher.rendezvous_timeout: who is missing (rank 0
        when its port is not out, else the ranks that did not join). A container the resource
        manager has run for a while whose agent never beat is named too, and replaced
        (launcher.beats.unheard), so that the next generation does not wait for it again; one
        that is merely late (allocated late) is waited for."""
        lj = self.job.launcher
        if keys.port(gen) not in seen:          # nobody could join: rank 0 is missing, and any never started
            missing = [self.members[0]["container"]] + [m["container"] for m in self.members[1:]
                                                        if keys.alive(m["container"]) not in seen]
        else:
            missing = [m["container"] for m in self.members[1:] if keys.joined(gen, m["rank"]) not in seen]
        never = [c for c in missing if keys.alive(c) not in seen]
        nodes = network.members_from(self.store)
        missing = [f"{c} on {nodes[c]['node']} ({nodes[c]['addr']})" if c in nodes else c for c in missing]
        try:
            unheard = beats.unheard(self.store, self.members, seen, lj.heartbeat_timeout, lj.rendezvous_timeout)
        except Exception as e:
            log.warning("could not ask the resource manager which containers run: %s", e)
            unheard = []
        note = ""
        if unheard:
            last = self.fails_with(gen, seen)
            for engine_id, group in ([] if last else unheard):
                self.ask_replacement(keys.replace(engine_id, "unheard"), {"engine_id": engine_id, "group": group})
            one = len(unheard) == 1
            note = (f"; {', '.join(e for e, _ in unheard)} {'runs' if one else 'run'}, but "
                    f"{'its agent' if one else 'their agents'} {UNHEARD} (frozen or stuck as it started, "
                    f"or still localizing its files: raise launcher.rendezvous_timeout for those)"
                    + ("" if last else f"; the resource manager is asked to replace {'it' if one else 'them'}"))
        if never and not unheard:
            they = 'it' if len(never) == 1 else 'they'
            note += (f"; {', '.join(never)} never reported: "
                     + (f"not started by the resource manager yet (it could not be asked), or stuck as {they} "
                        f"started" if self._rm_unasked else
                        f"stuck as {they} started, or started lately (the limit counts from the last start the "
                        f"resource manager reports)") + "; `yarnapp status` shows each container's state")
        importing = self.importing_members()
        if importing:
            note += (f"; {', '.join(importing)} still at work importing its code after {IMPORTING_LIMIT} times "
                     f"the limit (code that runs as it is imported and never ends?)")
        return Failure(kind=Kind.NOT_FORMED.value, container=self.ident.container, rank=self.ident.rank,
                       reason=f"world not formed within {lj.rendezvous_timeout:.0f}s; missing: "
                              f"{', '.join(missing) or 'none'}" + note + self.network_note()
                              + (overload_note() if self.ident.backend == "local" else ""))   # (YARN: the ranks' hosts')

    def judged_later(self, silent, limit, now):
        """Whether a peer's rank beat after this one (by more than a beat's period) and its
        agent has not yet had the time to judge it (the limit, its margin and a waiting rank's
        grace): this rank, found waiting, most likely waits for that one, whose agent will
        name it. A hang right after a step the slow rank reported late was blamed on the
        rank waiting for it. At most one such turn more: a peer that beats on while this
        rank waits (collectives that do not match) leaves this rank named."""
        turn = limit + min(2.0, limit / 2) + min(limit, stacks.WAITING_GRACE_S) + 2 * beats.BEAT_S
        if silent > 2 * turn:   # a peer that beats on while this rank waits in vain (mismatched collectives)
            return False
        return any(quiet < silent - beats.BEAT_S and quiet < turn for quiet in self.peers.rank_quiet(now).values())

    def called_apart(self, gen, seen):
        """A HUNG Failure when two ranks wait in calls of training.dist's collectives with the
        same number and different names (training.stalls: every rank's n-th call is the same
        in a correct program, so they never meet), naming where each waits; else None. Once
        every unfinished rank has said where it waits, or APART_GRACE_S after the conflict
        showed (a rank not in a call of the API by then is elsewhere). Only the agent of a
        rank found waiting judges (they all write the same line)."""
        waits, elsewhere = {}, []
        for m in self.members:
            raw = seen.get(keys.stall(gen, m["rank"]))
            rec = json.loads(raw) if raw else {}
            if rec.get("name"):
                waits[m["rank"]] = (m["container"], rec)
            elif keys.finished(gen, m["rank"]) not in seen:
                elsewhere.append(f"{m['rank']} ({m['container']})")
        by_call = {}
        for _, rec in waits.values():
            by_call.setdefault(rec["call"], set()).add(rec["name"])
        if self.ident.rank not in waits or not any(len(names) > 1 for names in by_call.values()):
            self.apart_since = None
            return None
        self.apart_since = self.apart_since or time.monotonic()
        if elsewhere and time.monotonic() - self.apart_since < APART_GRACE_S:
            return None
        at = {}
        for rank, (container, rec) in sorted(waits.items()):
            where = f"{rec['name']} (call {rec['call']} of training.dist" + \
                (f", at {rec['at']})" if rec.get("at") else ")")
            at.setdefault(where, []).append(f"{rank} ({container})")
        said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)} in {w}" for w, rs in at.items())
        if elsewhere:
            said += f"; rank{'s' if len(elsewhere) > 1 else ''} {', '.join(elsewhere)} elsewhere"
        self.apart_since = None
        return Failure(kind=Kind.HUNG.value, container=self.ident.container, rank=self.ident.rank, reason=(
            f"the ranks wait in {CALLED_APART}, which never meet: {said}; every rank must call them in the same "
            f"order (one made under `if rank == 0:`, or after a rank ran more steps than the others?)"))

    def behind_a_cut(self):
        """Whether some member's node is cut off (`yarnapp netem --cut`) and this container's
        is not: its rank waits for that member's, whose agent should name it (the first to
        record a hang is named, and a rank on a healthy node was, where the agents' limits
        came in another order)."""
        members = network.members_from(self.store)
        mine = members.get(self.ident.container)
        if not mine:
            return False
        cut = network.cut_nodes(self.store)
        return mine["node"] not in cut and any(m["node"] in cut for m in members.values())

    def network_note(self):
        """On emulated nodes: "; <which node is unreachable>" when the world hangs or cannot
        form because of the network (empty otherwise, and always on a shared host)."""
        members = network.members_from(self.store)
        cut = network.cut_nodes(self.store) if members else ()
        why = network.diagnose(members, self.ident.container, cut=cut) if members else ""
        return f"; network: {why}" if why else ""
