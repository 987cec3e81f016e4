"""All-reduce through shared memory, between ranks of one host.

Ranks joined as containers join are MPI singletons connected by ports, so MPICH sends
their messages through its network module even on one host (it has no shared-memory
path between singletons): the ring moves every byte through the kernel's sockets. When
every rank of a communicator is on the same host (the same boot and the same network
namespace: emulated hosts count as different hosts), `Arena.create` gives each rank a
segment that every other rank maps too, and a gradient bucket placed in it is reduced
by `SharedAllreduce` with plain loads and stores:

    rank r, on arrival of every rank at bucket k:
        S_r of the bucket (the ring's segment r)  <-  x_r + x_{r+1} + ... + x_{r+n-1}
            (read from each rank's segment, summed in that order chunk by chunk in cache),
        written into S_r of every rank's segment;
    then it waits until every rank has written its segment.

Each rank reads |x| and writes |x| bytes (n-1 of the n parts over to its peers), with no
copy in or out and no kernel in the way. The sum of segment j starts from x_j and adds
x_{j+1} ... x_{j+n-1}: exactly the ring's order (training.collectives.ring), so a bucket
gets the same bits through shared memory as through the ring, and a run moved between
one host and several resumes bit-identically.

Synchronisation is a pair of counters per bucket in each rank's segment (arrived, done;
only its owner writes them), compared against the run's sequence number. It relies on
x86-64's store ordering (a counter is written after the data it announces), so other
machines keep the ring. The files are unlinked as soon as every rank has mapped them: a
killed rank leaves nothing in /dev/shm. Space is reserved up front (posix_fallocate), so
a full /dev/shm (a container runtime's 64 MiB) makes `create` fall back to the ring
instead of a SIGBUS later.
"""
import logging
import mmap
import os
import platform
import socket
import uuid

import numpy as np
import torch

from .ring import _segments
from .waits import ring, wait_until

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
THRESHOLD_BYTES = 8 << 10         # smaller buckets keep MPI_Allreduce: ~3 us against ~6 us here
                                  # (benchmarks/allreduce.py --threshold-kb 1, 2 ranks)
CHUNK_BYTES = 256 << 10           # summed in cache, then stored to every rank's segment
_ALIGN = 4096
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


def host_key():
    """What ranks that can share memory have in common: the boot, the host name and the
    network namespace (ranks of two emulated hosts on one machine must not share)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot}/{socket.gethostname()}/{netns}"


class Arena:
    """One shared segment per rank of `comm`, mapped by every rank: `nbytes` of data
    (tensors from `tensor`) and the counters of `nops` reductions. Use `create`."""

    def __init__(self, comm, maps, nbytes, nops):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self._maps = maps
        self._start = ctrl = _round(16 * max(1, nops))      # the counters, then the data
        self.ctrl = [np.frombuffer(m, np.int64, 2 * max(1, nops)) for m in maps]
        self.data = [np.frombuffer(m, np.uint8, nbytes, ctrl) for m in maps]
        self.nops, self._next_op, self._used = nops, 0, 0

    @classmethod
    def create(cls, comm, nbytes, nops, enabled=True):
        """Collective over `comm`. The arena, or None (with the reason logged) when the ranks
        are not all on one host, this is not x86-64, or /dev/shm has no room for it."""
        size, rank = comm.Get_size(), comm.Get_rank()
        want = enabled and size > 1 and nbytes > 0 and _ORDERED_STORES and os.path.isdir(SHM_DIR)
        keys = comm.allgather(host_key() if want else None)
        if not all(keys) or len(set(keys)) != 1:
            if all(k is not None for k in keys):
                log.info("gradient reduction over the network: the ranks are on %d hosts", len(set(keys)))
            return None
        total = _round(16 * max(1, nops)) + _round(nbytes)
        base = comm.bcast(os.path.join(SHM_DIR, f"yarnapp-{uuid.uuid4().hex}") if rank == 0 else None, root=0)
        own, err = f"{base}-{rank}", None
        try:
            fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)      # ENOSPC now, not SIGBUS on a write later
            finally:
                os.close(fd)
        except OSError as e:
            err = f"{own}: {e.strerror}"
        maps = []
        try:
            if _all_ok(comm, err):
                for q in range(size):
                    try:
                        fd = os.open(f"{base}-{q}", os.O_RDWR)
                        try:
                            maps.append(mmap.mmap(fd, total))
                        finally:
                            os.close(fd)
                    except OSError as e:
                        err = f"{base}-{q}: {e.strerror}"
                        break
                if _all_ok(comm, err):
                    arena = cls(comm, maps, nbytes, nops)
                    arena.name = base
                    return arena
            for m in maps:
                m.close()
            log.warning("gradient reduction over the network: no shared memory (%s)", err or "a peer failed")
            return None
        finally:
            comm.Barrier()                            # every rank has mapped (or given up)
            try:
                os.unlink(own)
            except OSError:
                pass
            comm.Barrier()                            # nothing of it is left in /dev/shm

    def tensor(self, n, dtype):
        """The next `n` elements of this rank's data as a zeroed tensor (64-byte aligned)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        off = -(-self._used // 64) * 64
        if off + n * itemsize > self.data[self.rank].size:
            raise ValueError("Arena: out of space")
        self._used = off + n * itemsize
        return torch.frombuffer(self._maps[self.rank], dtype=dtype, count=n, offset=self._start + off)

    def allreduce(self, x):
        """A SharedAllreduce of tensor `x` (from `tensor`). Collective, in the same order."""
        if self._next_op >= self.nops:
            raise ValueError("Arena: more reductions than it was created for")
        op = SharedAllreduce(self, self._next_op, x)
        self._next_op += 1
        return op

    def close(self):
        self.ctrl = self.data = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:        # a tensor still views it: the mapping goes with it
                pass
        self._maps = []


class SharedAllreduce:
    """The in-place sum of one tensor of an Arena over its ranks: PreparedAllreduce's
    interface (run, or start / test / wait; one run in flight at a time)."""

    algorithm = "shm"

    def __init__(self, arena, index, x):
        self.arena, self.index, self.tensor = arena, index, x
        r, n = arena.rank, arena.size
        mine = x.numpy()
        base = mine.ctypes.data - arena.data[r].ctypes.data
        self.nbytes = mine.nbytes
        # every rank's copy of the tensor (the same offset in its segment)
        self._views = [np.frombuffer(arena.data[q], mine.dtype, mine.size, base) for q in range(n)]
        b = _segments(mine.size, n)
        lo, hi = b[r], b[r + 1]
        step = max(1, CHUNK_BYTES // mine.itemsize)
        order = [(r + k) % n for k in range(n)]          # the ring's order for segment r
        self._chunks = [(slice(a, min(a + step, hi)), order) for a in range(lo, hi, step)]
        self._arrived = [c[2 * index:2 * index + 1] for c in arena.ctrl]
        self._done = [c[2 * index + 1:2 * index + 2] for c in arena.ctrl]
        self._seq = int(self._arrived[r][0])
        self._phase = None          # None idle, 0 waiting for arrivals, 1 waiting for the others' writes

    def run(self):
        self.start()
        self.wait()

    def start(self):
        if self._phase is not None:
            raise RuntimeError("SharedAllreduce.start() while the previous run is in flight")
        self._seq += 1
        self._arrived[self.arena.rank][0] = self._seq     # after the data: x86-64 keeps store order
        self._phase = 0
        ring()      # wake the polite ranks waiting for it (collectives.doorbells)

    def test(self):
        """Progress without blocking; True once the sum is in the tensor."""
        if self._phase is None:
            return True
        if self._phase == 0:
            if not all(a[0] >= self._seq for a in self._arrived):
                return False
            self._reduce()
            self._done[self.arena.rank][0] = self._seq
            self._phase = 1
            ring()
        if all(d[0] >= self._seq for d in self._done):
            self._phase = None
            return True
        return False

    def wait(self):
        if self._phase is not None:
            wait_until(self.test)

    def _reduce(self):
        views = self._views
        for sl, order in self._chunks:
            acc = views[order[0]][sl]
            if len(order) == 2:
                np.add(acc, views[order[1]][sl], out=acc)
            else:
                acc = np.add(acc, views[order[1]][sl])
                for q in order[2:]:
                    np.add(acc, views[q][sl], out=acc)
                views[order[0]][sl] = acc
            for q in order[1:]:
                views[q][sl] = acc

    def free(self):
        self._views = self._chunks = None


def _all_ok(comm, err):
    return all(e is None for e in comm.allgather(err))


def _round(n):
    return -(-n // _ALIGN) * _ALIGN

