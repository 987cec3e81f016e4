"""Waiting for MPI requests, and tensors as MPI buffers (every strategy's waits).

`wait` completes requests as MPI does (MPICH spins), or, on a rank throttled by a CPU
quota (`set_polite`), spinning briefly and then sleeping between tests; where every
rank is on one host (`doorbells`), it sleeps until another rank enters an MPI wait (a
ring), and tests at the timed pace while one is in one (`in_mpi` marks). `as_buffer`
hands a contiguous CPU tensor to MPI as the numpy view of its own memory (no copy).
"""
import mmap
import os
import select
import socket
import threading
import time
import uuid

import numpy as np
import torch

from training import cputime

SPIN_S = 2e-4                       # a polite wait spins this long before it sleeps
MAX_PAUSE_S = 200e-6                # ... and then sleeps at most this long between tests

BELL_TIMEOUT_S = 2e-3               # with doorbells, a polite wait first sleeps at most this long between tests,
MAX_BELL_TIMEOUT_S = 8e-3           # ... doubling up to this while no ring comes

_polite = False
_MPI = None
wakeups = 0                         # polite waits' sleeps so far in this process (each costs a wake-up)
_bell = None                        # this polite rank's doorbell socket (doorbells)
_ringer = None                      # (socket, addresses of the other polite ranks' doorbells)
_poll = None                        # a poll object on _bell
_flags = None                       # (mmap, this rank's flag, the others' flags): who is in an MPI wait now


def _mpi():
    """mpi4py.MPI, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI
        _MPI = MPI
    return _MPI


def set_polite(flag):
    """Make every wait of this module (and of the strategies) sleep once it has spun SPIN_S.

    MPICH busy-polls inside blocking calls. That is right for a rank with a core of its
    own, and wrong for one throttled by a CPU quota (a 0.5-vcore container): it burns
    its quota spinning while it waits for the others, is then stopped by the scheduler,
    and every other rank waits for it in the next exchange. The runner turns this on
    for a rank whose vcores are fewer than its threads (`RankInfo.throttled`).
    """
    global _polite
    _polite = bool(flag)


def doorbells(comm):
    """Collective, after set_polite on every rank of `comm`: where all its ranks are on one
    host and some wait politely, give each polite rank a doorbell (a Unix datagram socket
    in the abstract namespace, named for this world) that every other rank rings when it
    starts a wait; a polite wait then sleeps until a ring (or BELL_TIMEOUT_S) instead of
    waking every MAX_PAUSE_S to test.

    Why: a wake-up costs ~30-40 µs of CPU here (the sleep and the scheduler; MPI's test
    is 0.2 µs), so a 0.5-vcore conv-MP worker that waits ~60 ms a step for the master's
    larger share woke ~300 times and spent ~10 ms of its quota a step on waking
    (`benchmarks/conv_mp.py --quick`, 1 + 0.5 vcore): a sixth of its compute. Longer
    pauses cost more than they saved (each of its ~10 waits a step ended later: 1 ms
    pauses, 170 ms a step against 150 ms). A rank ringing where nobody waits costs it a
    sendto (~3 µs); a polite rank drops the rings queued before its wait, and tests at
    the timed pace while a peer is in an MPI wait too (a byte per rank in shared memory
    says who is). Ranks on several hosts, or in network namespaces of their own, keep the
    timed pauses (a ring crosses neither: every rank rings every polite one here, and
    unless every ring is taken, none is armed); so do all where a rank cannot make a Unix
    socket or map /dev/shm."""
    global _bell, _ringer, _poll
    close_doorbells()
    rank = comm.Get_rank()
    every = comm.allgather((socket.gethostname(), _polite))
    token = comm.bcast(uuid.uuid4().hex[:16] if rank == 0 else None, root=0)
    polite = [r for r, (_, p) in enumerate(every) if p]
    if len({host for host, _ in every}) != 1 or not polite:
        return
    names = {r: f"\0yarnapp-bell-{token}-{r}".encode() for r in polite}
    others = [name for r, name in names.items() if r != rank]
    ok = True
    try:
        if rank in names:
            _bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _bell.bind(names[rank])
            _bell.setblocking(False)
            _poll = select.poll()
            _poll.register(_bell, select.POLLIN)
        if others:
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sender.setblocking(False)
            _ringer = (sender, others)
    except OSError:     # no Unix sockets here: every rank keeps the timed pauses
        ok = False
    ok = _share_flags(comm, token, ok)
    # every doorbell is bound (or none is) before anyone rings; then can every ring reach
    # its doorbell? Not across network namespaces (emulated hosts): abstract sockets are
    # per namespace, and a name nobody bound there is refused. (A full queue, EAGAIN, is
    # a doorbell that is there.)
    if comm.allreduce(int(ok), op=_mpi().MIN):
        ok = ring()
    if not comm.allreduce(int(ok), op=_mpi().MIN):
        close_doorbells()


def _share_flags(comm, token, ok):
    """Collective: map one byte per rank that says whether that rank is in an MPI wait
    (a file in /dev/shm, unlinked once every rank has mapped it); whether every rank has."""
    global _flags
    MIN, rank, size = _mpi().MIN, comm.Get_rank(), comm.Get_size()
    path = f"/dev/shm/yarnapp-bell-{token}"
    if rank == 0 and ok:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)     # ENOSPC now (no doorbells), not SIGBUS on a write later
            finally:
                os.close(fd)
        except OSError:
            ok = False
    if comm.allreduce(int(ok), op=MIN):
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                area = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            flags = np.frombuffer(area, np.uint8)
            _flags = (area, flags[rank:rank + 1], flags[:rank], flags[rank + 1:])
        except OSError:
            ok = False
    else:
        ok = False
    comm.Barrier()
    if rank == 0:
        try:
            os.unlink(path)
        except OSError:
            pass
    return ok


def close_doorbells():
    global _bell, _ringer, _poll, _flags
    if _bell is not None:
        _bell.close()
    if _ringer is not None:
        _ringer[0].close()
    _bell = _ringer = _poll = _flags = None
    in_mpi._depth = 0       # (armed and closed outside any wait)


class _InMpi:
    """`with in_mpi:` (or enter() ... leave()) around an MPI wait, or while an operation
    this rank progresses by tests is in flight: rings the polite ranks' doorbells and
    marks this rank as in MPI (its peers' polite waits then test at the timed pace: a
    transfer that needs both sides' progress moves) until it leaves. Counted: nested and
    concurrent (a communication thread's) uses ring and mark once, and the mark stays
    until the last one leaves."""

    def __init__(self):
        self._depth = 0
        self._lock = threading.Lock()

    def enter(self):
        if _flags is None:      # not armed: every MPI wait passes here (a 1 KiB sum takes 2 µs)
            return
        with self._lock:
            self._depth += 1
            first = self._depth == 1
        if first:
            _mark(1)
            ring()

    def leave(self):
        if _flags is None:
            return
        with self._lock:
            self._depth -= 1
            last = self._depth == 0
        if last:
            _mark(0)

    __enter__ = enter

    def __exit__(self, *exc):
        self.leave()


def _mark(value):
    _flags[1][0] = value


in_mpi = _InMpi()


def _peers_in_mpi():
    return bool(_flags[2].any() or _flags[3].any())


def ring():
    """Wake the polite ranks' waits (doorbells): this rank is in MPI now. Whether every
    doorbell took the ring: a full queue (EAGAIN: it is not waiting) is one that is there;
    a name nobody bound here (gone, or another network namespace) is not."""
    if _ringer is None:
        return True
    sender, names = _ringer
    taken = True
    for name in names:
        try:
            sender.sendto(b"!", name)
        except BlockingIOError:
            pass
        except OSError:
            taken = False
    return taken


def _drain():
    """Drop the rings queued at this rank's doorbell."""
    try:
        while True:
            _bell.recv(16)
    except OSError:
        pass


def is_polite():
    """Whether this process's waits are polite (set_polite)."""
    return _polite


def wait(reqs, polite=None):
    """Complete one MPI request or a list of them.

    Not polite: MPI_Waitall (MPICH spins). Polite (the module setting, or `polite=True`):
    test for SPIN_S (while the peers are present, a pipelined transfer completes in this
    phase at full speed), then sleep between tests, 20 µs doubling up to MAX_PAUSE_S; with
    doorbells, only while another rank is in MPI too, else until a ring (_doorbell_wait).
    Either way this rank is marked in MPI meanwhile, and rings the polite ranks' doorbells.
    """
    with cputime.counting("wait"):
        _wait(reqs, polite)


def _wait(reqs, polite):
    mpi = _mpi()
    many = isinstance(reqs, (list, tuple))
    with in_mpi:
        if not (_polite if polite is None else polite):
            if many:
                mpi.Request.Waitall(reqs)
            else:
                reqs.Wait()
            return
        _sleepy((lambda: mpi.Request.Testall(reqs)) if many else reqs.Test)


def wait_until(test, polite=None):
    """Call `test()` until it returns True: spinning, or, polite (as `wait`), spinning for
    SPIN_S and then sleeping between calls (shared-memory reductions wait with this).
    Off the main thread a spin yields the GIL at every call: the thread that runs
    backward must not wait for a communication thread's spinning."""
    with cputime.counting("wait"), in_mpi:
        if _polite if polite is None else polite:
            _sleepy(test)
        elif threading.current_thread() is threading.main_thread():
            while not test():
                pass
        else:
            while not test():
                time.sleep(0)


def _sleepy(test):
    global wakeups
    if _bell is not None and threading.current_thread() is threading.main_thread():
        _doorbell_wait(test)    # (the main thread's only: two threads would take each other's rings)
        return
    deadline = time.perf_counter() + SPIN_S
    while time.perf_counter() < deadline:
        if test():
            return
    pause = 20e-6
    while not test():
        wakeups += 1
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)


def _doorbell_wait(test):
    """Test, spinning SPIN_S; then, while another rank is in an MPI wait too, test at the
    timed pace (a transfer that needs both sides' progress moves: a 4 MiB message to a
    rank that came last took 11 ms sleeping until rings, 1.5 ms so); while none is, sleep
    until a ring (a rank entering a wait) or a timeout, and spin SPIN_S after a ring.
    Asleep, this rank is not marked in MPI (two polite ranks waiting for a third would
    otherwise keep each other at the timed pace). The timeout, for a peer that finishes
    its part without ringing (a blocking MPI call of its own), starts at BELL_TIMEOUT_S
    and doubles up to MAX_BELL_TIMEOUT_S while no ring comes: a 0.5-vcore conv-MP worker
    waits ~90 ms a step for the master's larger share, mostly in stretches of 10-50 ms
    with no MPI call on the other side, and woke every 2 ms through them (~45 wake-ups a
    step at ~40 µs of CPU each, `benchmarks/conv_mp.py --quick`, 1 + 0.5 vcore)."""
    global wakeups
    _drain()                            # rings from before this wait
    spin, pause, timeout = SPIN_S, 20e-6, BELL_TIMEOUT_S
    while True:
        deadline = time.perf_counter() + spin
        while True:
            if test():
                return
            if time.perf_counter() >= deadline:
                break
        wakeups += 1
        if _peers_in_mpi():
            time.sleep(pause)
            pause, spin = min(pause * 2, MAX_PAUSE_S), 0.0
            continue
        if test():      # a peer may have sent its last part and left between the test and the look
            return
        _mark(0)
        try:
            rung = _poll.poll(timeout * 1e3)
        finally:
            _mark(1)
        if rung:
            _drain()
        spin, pause = (SPIN_S if rung else 0.0), 20e-6
        timeout = BELL_TIMEOUT_S if rung else min(2 * timeout, MAX_BELL_TIMEOUT_S)


def mpi_datatype(dtype):
    """The MPI datatype of a float32/float64 torch dtype (what model-parallel layers send)."""
    from mpi4py import MPI
    if dtype == torch.float32:
        return MPI.FLOAT
    if dtype == torch.float64:
        return MPI.DOUBLE
    raise TypeError(f"MPI transfers here support float32 and float64 tensors, not {dtype}")


def as_buffer(x):
    """The 1-D numpy view of a tensor's memory (no copy), for use as an MPI buffer.

    Accepts a contiguous CPU torch tensor (with or without requires_grad) or a
    contiguous numpy array; anything else would need a copy, which would silently
    drop the result of an in-place reduction.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"all-reduce needs a CPU tensor, got one on {x.device}; "
                             "move it with .cpu() (and copy the result back)")
        arr = x.detach().numpy() if x.requires_grad else x.numpy()
    else:
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError("all-reduce needs a contiguous tensor; reduce x.contiguous() and "
                         "copy the result back")
    return arr if arr.ndim == 1 else arr.reshape(-1)

