"""Whether a whole container still lives: every agent's beat, and the peers whose beat stopped.

A rank that stops is seen by its own agent (launcher.agent: its heartbeat file). A container
that stops whole (its agent and its rank: a frozen VM, a host cut off, SIGSTOP of its process
group) has nobody left inside to say so, and its peers' ranks merely wait in a collective.
So every agent rewrites `launcher.keys.beat(container)` every BEAT_S from a thread of its
own, and every agent watches its peers' beats: one that has not changed for the limit, on
the watcher's own clock (no clocks are compared across hosts), is frozen.
"""
import json
import logging
import threading
import time

from . import keys

log = logging.getLogger("launcher.beats")

BEAT_S = 1.0             # how often an agent's thread rewrites its beat
FROZEN_MIN_S = 5.0       # a peer is judged after launcher.heartbeat_timeout, never sooner


def start(store, container, record):
    """Rewrite `container`'s beat (`record` plus a count) every BEAT_S from a daemon thread,
    so that it stops only when the whole process does, not while the agent's loop waits."""
    def beat():
        n = 0
        while True:
            n += 1
            try:
                store.put(keys.beat(container), json.dumps({**record, "n": n}), owned=True)
            except Exception as e:      # the store unreachable for a moment: the peers judge
                log.warning("could not write the beat: %s", e)
            time.sleep(BEAT_S)
    threading.Thread(target=beat, name="beat", daemon=True).start()


class Watch:
    """The peers' beats as one agent has seen them change."""

    def __init__(self, members, me, limit):
        self.peers = [m["container"] for m in members if m["container"] != me]
        self.limit = max(limit, FROZEN_MIN_S)
        self.seen = {}           # peer -> (its last beat, when this agent saw it change: monotonic)

    def frozen(self, snapshot, now):
        """A peer whose beat has not changed for `limit` seconds: (container, seconds, its
        last beat as a dict), or None. `snapshot` holds the beat/, done/ and replace/ keys. A
        peer without a beat (not started, or finished) is not judged, nor one whose
        replacement was asked for already (its beat goes with it)."""
        for c in self.peers:
            raw = snapshot.get(keys.beat(c))
            if raw is None or keys.done(c) in snapshot or \
                    keys.replace(c, json.loads(raw)["incarnation"]) in snapshot:
                self.seen.pop(c, None)
                continue
            last = self.seen.get(c)
            if last is None or last[0] != raw:
                self.seen[c] = (raw, now)
            elif now - last[1] > self.limit:
                return c, now - last[1], json.loads(raw)
        return None
