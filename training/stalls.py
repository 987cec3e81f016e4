"""A rank's long waits in training.dist's collectives, told to its agent: the proof that
the ranks' code calls different collectives.

Every collective of the API (training.dist: a broadcast, an allreduce, the optimizer
step's sum of gradients...) is one call, counted per rank: in a correct program every
rank makes the same calls in the same order, so its n-th call is every rank's n-th. A
rank whose call has lasted WAIT_S publishes which it is (launcher.keys.stall: its number,
its name, the line of the user's code it came from), and publishes again when it leaves
it. Two ranks waiting in calls of the same number and different names can never meet:
`if rank == 0: broadcast_parameters(...)` after the optimizer is wrapped left rank 0 in
its broadcast and the others in their first step's sum, before any progress report, so
nothing judged it and the application hung for good. Their agents (launcher.diagnosis
`called_apart`) end the generation naming each rank's call and line, and it is not
retried: every attempt runs the same code. Horovod's stall inspector warns of a tensor
that some ranks did not submit, after a minute; here the world ends in one line.

Waits of other kinds (torch.distributed, the communicator's own methods) are not
counted; a hang in them is judged from the ranks' silence (launcher.agent).
"""
import contextlib
import json
import os
import sys
import threading
import time

WAIT_S = 5.0        # a call this long is published (a rank may wait this long for a slow peer)
CHECK_S = 1.0       # how often the watcher looks

_calls = None       # this rank's Calls (one per RunContext: a generation's)


class Calls:
    """The calls one rank makes, and a daemon thread that publishes one that lasts."""

    def __init__(self, ctx):
        from launcher import keys
        self.key = keys.stall(ctx.generation, ctx.rank)
        self.publish = ctx.publish
        self.ctx = ctx
        self.count = 0
        self.now = None         # (number, name, monotonic start, thread id) of the call in progress
        self.told = 0           # the number of the call last published
        threading.Thread(target=self._watch, name="yarnapp-stalls", daemon=True).start()

    @contextlib.contextmanager
    def within(self, name):
        self.count += 1
        n = self.count
        self.now = (n, name, time.monotonic(), threading.get_ident())
        try:
            yield
        finally:
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
            self.told = n
            self._put({"call": n, "name": name, "at": user_line(thread), "time": time.time()})

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
    if _calls is None or _calls.ctx is not ctx:
        _calls = Calls(ctx)
    return _calls.within(name)


def user_line(thread):
    """"file:line in function" of the innermost frame of the user's own code in `thread`'s
    stack now (not yarnapp's, a library's or Python's), or ""."""
    from launcher.stacks import ours_or_library
    frame = sys._current_frames().get(thread)
    while frame is not None:
        code = frame.f_code
        if not ours_or_library(code.co_filename):
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return ""
