"""Whether a whole container still lives: every agent's beat, and the peers whose beat stopped.

A rank that stops is seen by its own agent (launcher.agent: its heartbeat file). A container
that stops whole (its agent and its rank: a frozen VM, a host the store cannot reach, SIGSTOP
of its process group) has nobody left inside to say so, and its peers' ranks merely wait in
a collective. So every agent rewrites `launcher.keys.beat(container)` every BEAT_S from a
thread of its own, and every agent watches its peers' beats: one that has not changed for
the limit, on the watcher's own clock (no clocks are compared across hosts), is frozen. A
watcher whose own beat is not fresh judges nobody: the store, or the watcher, stalled.
"""
import json
import logging
import threading

from . import keys

log = logging.getLogger("launcher.beats")

BEAT_S = 1.0             # how often an agent's thread rewrites its beat
FROZEN_MIN_S = 10.0      # a peer is judged after launcher.heartbeat_timeout, never sooner (above the
                         # seconds YARN takes to report a dead container: launcher.store.Store.death_notice_s)
FRESH_S = 3 * BEAT_S     # a watcher whose own beat is unchanged longer judges nobody
SUSPECT_S = 3 * BEAT_S   # a peer silent this long, while this agent's rank waits in vain, is the cause


def limit_for(heartbeat_timeout):
    """How long a container's agent may stay silent before it is judged frozen."""
    return max(heartbeat_timeout, FROZEN_MIN_S)


def start(store, container, record, extra=None):
    """Rewrite `container`'s beat (`record` plus a count, plus what `extra()` returns then)
    every BEAT_S from a daemon thread, so that it stops only when the whole process does,
    not while the agent's loop waits. Returns the Event that stops it."""
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.is_set():
            n += 1
            try:
                more = extra() if extra else {}
            except Exception:           # what the beat adds must never stop it
                more = {}
            try:
                store.put(keys.beat(container), json.dumps({**record, **more, "n": n}), owned=True)
            except Exception as e:      # the store unreachable for a moment: the peers judge
                log.warning("could not write the beat: %s", e)
            stop.wait(BEAT_S)
    threading.Thread(target=beat, name="beat", daemon=True).start()
    return stop


class Watch:
    """The beats (a watcher's own and its peers') as one agent has seen them change."""

    def __init__(self, members, me, limit):
        self.me = me
        self.peers = [m["container"] for m in members if m["container"] != me]
        self.limit = limit_for(limit)
        self.seen = {}           # container -> (its last beat, when this agent saw it change: monotonic)
        self.trusted_since = None    # since when this agent's own beat has been fresh

    def update(self, snapshot, now):
        """Take the beats in `snapshot` (with its done/ and replace/ keys). A peer without a
        beat (not started, or finished), or whose replacement was asked for already (its beat
        goes with it), is not watched."""
        for c in [self.me, *self.peers]:
            raw = snapshot.get(keys.beat(c))
            if raw is None or keys.done(c) in snapshot or \
                    keys.replace(c, json.loads(raw)["incarnation"]) in snapshot:
                self.seen.pop(c, None)
                continue
            last = self.seen.get(c)
            if last is None or last[0] != raw:
                self.seen[c] = (raw, now)
                if c == self.me and (last is None or now - last[1] > FRESH_S):
                    self.trusted_since = now     # from here on a peer's silence is its own

    def silent(self, now, at_least):
        """The peers silent for more than `at_least` seconds, longest first: a list of
        (container, seconds, its last beat as a dict). Silence counts only while this
        watcher's own beat is fresh: a stalled store stills every beat at once, and a
        watcher cannot tell that from a frozen peer."""
        own = self.seen.get(self.me)
        if own is None or now - own[1] > FRESH_S:
            return []
        quiet = [(c, now - max(self.seen[c][1], self.trusted_since)) for c in self.peers if c in self.seen]
        return [(c, s, json.loads(self.seen[c][0])) for c, s in sorted(quiet, key=lambda cs: -cs[1])
                if s > at_least]

    def rank_quiet(self, now):
        """{peer: seconds since its rank last beat, as its agent last said (`rank_quiet` in
        its beat, on its own clock) plus the time since this watcher saw that beat}, for the
        peers whose agents say."""
        out = {}
        for c in self.peers:
            if c in self.seen:
                quiet = json.loads(self.seen[c][0]).get("rank_quiet")
                if quiet is not None:
                    out[c] = quiet + now - self.seen[c][1]
        return out

    def saying(self, flag):
        """The peers whose agents say `flag` of their rank in its beat: "rank_busy", silent in
        its progress and at work (launcher.activity: an evaluation on one rank, which its peers
        wait for, idle, in their next collective); "rank_importing", at work in its start, not
        yet joining the world (launcher.diagnosis: importing)."""
        return [c for c in self.peers if c in self.seen and json.loads(self.seen[c][0]).get(flag)]

    def frozen(self, snapshot, now):
        """update, then the peers silent for longer than the limit (see silent)."""
        self.update(snapshot, now)
        return self.silent(now, self.limit)


def unheard(store, members, seen, heartbeat_timeout, rendezvous_timeout):
    """The containers the resource manager has run for longer than the frozen limit (see
    limit_for) and half the rendezvous timeout (skein reports a container running while its
    node may still localize its files), for members without a beat in `seen` (an agent's
    snapshot of the store): their agents never beat, frozen or stuck as they started, so no
    peer has a beat to watch. [(engine_id, group)]; none on the local engine, whose master
    replaces those itself (launcher.store.Store.unheard). The beats are read again before
    the answer: an agent that beat meanwhile is heard."""
    quiet = sorted({m["group"] for m in members
                    if keys.beat(m["container"]) not in seen and keys.done(m["container"]) not in seen})
    if not quiet:
        return []
    found = store.unheard(quiet, _engine_ids(seen), max(limit_for(heartbeat_timeout), rendezvous_timeout / 2))
    heard = _engine_ids(store.get_prefix(keys.BEAT_PREFIX)) if found else set()
    return [(e, g) for e, g in found if e not in heard]


def _engine_ids(beats):
    return {json.loads(v)["engine_id"] for k, v in beats.items() if k.startswith(keys.BEAT_PREFIX)}
