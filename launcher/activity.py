"""Whether a silent rank of the job's own code is at work or idle (launcher.monitor's
judgement of a hang): an evaluation on rank 0 alone is at work, not hung, and its peers
waiting for it are not hung either (each agent says `rank_busy` in its beat); a rank
asleep, in a lock, in a polite collective, or spinning in a wait for its peers is idle.
"""
import collections
import math

from . import stacks
from .procs import cpu_seconds

IDLE_CPU = 0.05             # of a core: a silent rank using less is idle


class Activity:
    """One rank's CPU over its silence, and where its stack was last found."""

    def __init__(self):
        self.reset()

    def reset(self):
        """The rank beats again (or is new): nothing known."""
        self.samples = collections.deque()      # (monotonic time, CPU seconds)
        self.busy = False           # at work: using CPU, and not in a wait for its peers (said in beats)
        self.cpu_busy = False       # using CPU, wherever
        self.stack_at, self.in_wait = -math.inf, False

    @property
    def known(self):
        return bool(self.samples) or self.busy

    def sample(self, pid, now, limit, waiting=False):
        """Whether the rank used at least IDLE_CPU of a core over the last `limit` seconds
        (launcher.idle_timeout or heartbeat_timeout; sampled at most once a second from half
        that silence on) and is not `waiting`: in a call of training.dist for more than
        training.stalls.WAIT_S (with a core of its own it spins in MPI's wait; its call,
        published by training.stalls, says so), nor found in one by `in_a_wait`. Not yet
        known (samples less than a second apart): busy."""
        if not self.samples or now - self.samples[-1][0] >= 1.0:      # (psutil reads /proc)
            cpu = cpu_seconds(pid)
            if cpu is None:
                self.busy = False
                return False
            self.samples.append((now, cpu))
        while now - self.samples[0][0] > max(limit, 2.0):   # (at least two samples a second apart)
            self.samples.popleft()
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        self.cpu_busy = t1 - t0 < 1.0 or (c1 - c0) >= IDLE_CPU * (t1 - t0)
        self.busy = not waiting and not self.in_wait and self.cpu_busy
        return self.busy

    def in_a_wait(self, pid, stack_file, now, limit):
        """Whether the rank, silent past its limit and using CPU, spins in a wait for its peers
        (MPI's busy-poll in a blocking call: `ctx.comm.Allreduce`, a 1-vcore rank in a call of
        training.dist), from its stack: asked when judged, at most every half limit (a rank at
        work is sent SIGUSR1 that often, past its limit only). Not at work, then."""
        if now - self.stack_at >= max(1.0, limit / 2):
            at = stacks.where(stacks.dump(pid, stack_file))
            self.stack_at, self.in_wait = now, bool(at and at.waiting)
        if self.in_wait:
            self.busy = False
        return self.in_wait

    def at_work_after_all(self, now):
        """A later look at its stack found it out of the wait (a short collective sampled)."""
        self.stack_at, self.in_wait = now, False
