"""The local master's watch over its containers' agents, as YARN's ResourceManager and
skein's master watch theirs (mixed into yarnapp.backends.local.am.ApplicationMaster): a
container its peers asked to replace (frozen), one whose agent never beat after its
start, one whose agent went silent after its peers ended (nobody else watches it then),
and the supervisor that would start the next master attempt, gone."""
import json
import logging
import os
import subprocess
import time

from launcher import beats, keys
from launcher.failure import Failure, Kind, current_generation, spends_the_last_restart

log = logging.getLogger("yarnapp.am")


class Watchdog:
    """Uses the master's job, store, containers, extra, beats_seen, looked and save()."""

    def replace_frozen(self, handled):
        """Act on the agents' requests (launcher.keys.replace) to replace a container whose
        agent went silent: kill it, when that incarnation still holds it; the loop then sees
        it exit and starts it anew (container_exited)."""
        for key, raw in self.store.get_prefix(keys.REPLACE_PREFIX).items():
            if key in handled:
                continue
            handled.add(key)
            _, container, incarnation = key.split("/")
            c = next((c for c in self.containers if c.id == container and c.state == "RUNNING"), None)
            alive = self.store.get(keys.alive(container))
            if c is None or alive is None or json.loads(alive).get("incarnation") != incarnation:
                continue             # it exited or was replaced meanwhile
            c.replacing = json.loads(raw)
            log.warning("killing %s to replace it: its agent was silent for %ss (seen by %s)",
                        c.id, c.replacing.get("silent_s"), c.replacing.get("by"))
            c.kill()

    def never_beaten(self):
        """A container whose agent has not beaten within the frozen limit of its start (it
        froze, or hangs, as it started): its peers cannot watch a beat that never came, but
        the master, which started it, can. The generation ends naming it, and it is replaced
        while restarts remain (the agents' count, launcher.failure.spent_restarts)."""
        limit = beats.limit_for(self.job.launcher.heartbeat_timeout)
        for c in self.containers:
            if c.state != "RUNNING" or c.beaten or c.replacing:
                continue
            if self.store.get(keys.beat(c.id)) is not None:
                c.beaten = True
            elif time.monotonic() - c.started > limit:
                gen = current_generation(self.store)
                last = spends_the_last_restart(self.store, gen, self.job.max_restarts)
                self.store.put_if_absent(keys.abort(gen), Failure(
                    kind=Kind.LOST.value, container=c.id, rank=c.member["rank"], observed_by="master",
                    reason=f"lost {c.id}: its agent never reported (no beat within {limit:g}s of its start, "
                           f"limit: launcher.heartbeat_timeout; frozen or stuck as it started)"
                           + ("" if last else "; it is replaced")).stamped(generation=gen).dumps())
                log.warning("killing %s to replace it: no beat within %gs of its start", c.id, limit)
                c.replacing = {"by": "master"}
                c.kill()

    def frozen_after_the_end(self):
        """A container whose agent went silent after a peer's ended SUCCEEDED: its peers, gone,
        no longer watch its beat, and the application stayed RUNNING until someone resumed
        it. Past the frozen limit it is killed: SUCCEEDED where its rank's code finished in
        the generation its peers finished (the world agreed the end), else FAILED, named."""
        done = next((c for c in self.containers if c.state == "SUCCEEDED"), None)
        now, before, self.looked = time.monotonic(), self.looked, time.monotonic()
        if done is None:
            return
        if before is not None and now - before > beats.FRESH_S:
            self.beats_seen.clear()         # the master itself was stopped (a paused host): judge nobody
            return
        limit = beats.limit_for(self.job.launcher.heartbeat_timeout)
        for c in self.containers:
            if c.state != "RUNNING" or c.replacing:
                continue
            beat, last = self.store.get(keys.beat(c.id)), self.beats_seen.get(c.id)
            if last is None or last[0] != beat:
                self.beats_seen[c.id] = (beat, now)
                continue
            if now - last[1] <= limit:
                continue
            gen = json.loads(self.store.get(keys.done(done.id)) or "{}").get("generation")
            finished = gen is not None and self.store.get(keys.finished(gen, c.member["rank"])) is not None
            silent = f"its agent was silent for {now - last[1]:.0f}s (limit {limit:g}s: launcher.heartbeat_timeout)"
            c.state = "SUCCEEDED" if finished else "FAILED"
            c.kill()
            try:
                c.exit_code = c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:   # (a process in D state: its end is the shutdown's to wait for)
                c.exit_code = None
            self.store.release(c.id)
            c.exits.append({"attempt": c.attempts, "exit_code": c.exit_code, "time": time.time(),
                            "note": f"killed: {silent} after {done.id} ended"})
            if finished:
                log.warning("%s: %s after its rank's code finished; killed, and taken as ended", c.id, silent)
            else:
                self.store.put_if_absent(keys.FAILED, Failure(
                    kind=Kind.LOST.value, container=c.id, rank=c.member["rank"], observed_by="master",
                    reason=f"lost {c.id}: {silent}, after {done.id} ended and before its rank's code finished"
                ).stamped(generation=gen).dumps())
        self.looked = time.monotonic()      # (a kill's wait is no pause of the master's)

    def supervisor_lost(self, parent):
        """Say once, in the master's log and status, that its supervisor is gone (killed from
        outside): should this master die, no attempt follows, and nothing else would say why."""
        if "supervisor_lost" in self.extra or os.getppid() == parent:
            return
        self.extra["supervisor_lost"] = time.time()
        log.warning("its supervisor (pid %d) is gone: should this application master die, no other attempt "
                    "starts", parent)
        self.save()
