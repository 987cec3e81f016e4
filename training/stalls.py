"""Ranks that call different collectives of training.dist, found instead of hung.

Every collective of the API (training.dist: a broadcast, an allreduce, an optimizer
step's sum of gradients...) is one call, counted per rank: in a correct program every
rank makes the same calls in the same order, so its n-th call is every rank's n-th.

- The first call of a world (`collective`), collectively: every rank says which it is
  in, and its doorbells are armed (training.collectives.doorbells: where every rank is on
  one host, a throttled rank's waits sleep until another rank starts a wait). A Horovod
  slip, `if rank == 0: broadcast_parameters(...)` before the optimizer is wrapped, matched
  rank 0's broadcasts with the others' next collectives: it hung, or trained apart.
- Any later call that lasts WAIT_S is published (launcher.keys.stall: its number, name and
  the user's line it came from), and published again once left. Two ranks waiting in
  calls of the same number and different names never meet: a rank-0-only broadcast after
  the optimizer is wrapped left rank 0 in its broadcast and the others in their first
  step's sum, before any progress report, and the application hung for good; a rank one
  step ahead met the others' `allreduce` of a metric and hung until heartbeat_timeout,
  then again at every retry. Their agents (launcher.diagnosis `called_apart`) end the
  generation naming each rank's call and line, not retried: every attempt runs the same
  code. (Horovod's stall inspector warns of a tensor some ranks did not submit, after a
  minute.) A check at every call would be a collective of its own; this costs nothing
  until a call lasts.

Waits of other kinds (torch.distributed, the communicator's own methods) are not counted;
a hang in them is judged from the ranks' silence (launcher.agent).
"""
import contextlib
import json
import os
import sys
import threading
import time

WAIT_S = 5.0        # a call this long is published (a rank may wait this long for a slow peer)
CHECK_S = 1.0       # how often the watcher looks

_calls = None       # this rank's Calls: one per (generation, rank)
_armed = None       # the communicator whose first call was checked (collective)


class Calls:
    """The calls one rank makes, and a daemon thread that publishes one that lasts."""

    def __init__(self, ctx):
        from launcher import keys
        self.who = (ctx.generation, ctx.rank)
        self.key = keys.stall(*self.who)
        self.publish = ctx.publish
        self.count = 0
        self.now = None         # (number, name, monotonic start, thread id) of the call in progress
        self.told = 0           # the number of the call last published as waited in
        self.lock = threading.Lock()
        self.main = threading.main_thread().ident
        threading.Thread(target=self._watch, name="yarnapp-stalls", daemon=True).start()

    @contextlib.contextmanager
    def within(self, name):
        self.count += 1
        n = self.count
        self.now = (n, name, time.monotonic(), threading.get_ident())
        try:
            yield
        finally:
            with self.lock:     # the watcher publishes a wait only while the call lasts
                self.now = None
                if self.told == n:
                    self._put({"call": n, "name": None})

    def _watch(self):
        while True:
            time.sleep(CHECK_S)
            now = self.now
            if now is None or now[0] == self.told or time.monotonic() - now[2] < WAIT_S:
                continue
            n, name, _, thread = now
            at = user_line(thread) or user_line(self.main)  # (a CUDA backward's sum runs on torch's thread)
            with self.lock:
                if self.now is now:
                    self.told = n
                    self._put({"call": n, "name": name, "at": at, "time": time.time()})

    def _put(self, record):
        try:
            self.publish(self.key, json.dumps(record))
        except Exception:  # noqa: BLE001 - the store unreachable: the agents judge by silence
            pass


def within(ctx, name):
    """A context manager around one collective call `name` of the API on this rank (a
    no-op outside a yarnapp container: nobody to tell)."""
    global _calls
    if ctx.publish is None or ctx.world_size < 2:
        return contextlib.nullcontext()
    if _calls is None or _calls.who != (ctx.generation, ctx.rank):     # (every step passes here)
        _calls = Calls(ctx)
    return _calls.within(name)


@contextlib.contextmanager
def collective(ctx, name):
    """ctx.comm, for one collective call `name` of the API made inside the block (`within`);
    the world's first is checked collectively (module docstring)."""
    global _armed
    with within(ctx, name):
        comm = ctx.comm
        if _armed is not comm:
            names = comm.allgather(name) if ctx.world_size > 1 else [name]
            from . import collectives
            collectives.doorbells(comm)
            _armed = comm
            if len(set(names)) > 1:
                from conf.errors import YarnappError
                where = {}
                for r, c in enumerate(names):
                    where.setdefault(c, []).append(str(r))
                said = "; ".join(f"rank(s) {', '.join(rs)} in {c}" for c, rs in where.items())
                raise YarnappError(f"the ranks' first collectives of training.dist differ ({said}): every rank "
                                   f"calls them, in the same order; a broadcast too (not under `if rank == 0`: "
                                   f"root_rank says whose values every rank gets)")
        yield comm


def current():
    """(number, name) of this rank's call in progress, or None where calls are not counted
    (outside a container, a world of one)."""
    now = _calls.now if _calls is not None else None
    return now[:2] if now else None


def check_root_call(ctx, root, theirs, at):
    """After a broadcast: raise YarnappError where the root's call (`theirs`, its number and
    name, made `at` its line) is not this rank's. A broadcast's root does not wait for the
    others: a rank-0-only broadcast of a few bytes returned at once, its message waited,
    and the next broadcast of the other ranks took it: stale values, and the application
    SUCCEEDED (no rank ever waited, so none was published)."""
    mine = current()
    if mine is None or theirs is None or tuple(theirs) == mine:
        return
    from conf.errors import YarnappError
    from launcher.failure import CALLED_APART
    raise YarnappError(f"rank {ctx.rank}'s call {mine[0]} of training.dist, {mine[1]}, received rank {root}'s call "
                       f"{theirs[0]}, {theirs[1]}{f' at {at}' if at else ''}: the ranks made {CALLED_APART}; every "
                       f"rank calls them, in the same order; a broadcast too (not under `if rank == 0`: root_rank "
                       f"says whose values every rank gets)")


def user_line(thread):
    """"file:line in function" of the innermost frame of the user's own code in `thread`'s
    stack now (not yarnapp's, a library's or Python's), or ""."""
    from launcher.stacks import users_frame
    frame, frames = sys._current_frames().get(thread), []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    user = users_frame(frames)
    return f"{os.path.basename(user[0])}:{user[1]} in {user[2]}" if user else ""
