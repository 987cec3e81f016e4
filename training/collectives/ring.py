"""All-reduce of a tensor: MPI's for small ones, a bandwidth-optimal ring for large ones.

`allreduce_(x, comm)` replaces, on every rank r of `comm`, x_r by  sum_q x_q.
Small messages use MPI's own MPI_Allreduce (latency bound: MPICH's recursive
doubling needs log2(n) rounds). Large ones use a bandwidth-optimal ring:
x is cut into n segments S_0..S_{n-1} (sizes differ by at most one element), then

    reduce-scatter, step s = 0..n-2: rank r sends S_{(r-s) mod n} to r+1 and adds the
        S_{(r-s-1) mod n} it receives from r-1 into its own: afterwards rank r holds
        the complete sum of S_{(r+1) mod n};
    all-gather,     step s = 0..n-2: rank r sends S_{(r+1-s) mod n} to r+1 and stores the
        S_{(r-s) mod n} it receives from r-1.

Every rank sends and receives 2 (n-1)/n |x| bytes, the lower bound for all-reduce.
Each step is cut into chunks (`chunk_bytes`, 1 MiB by default: the best of
256 KiB..4 MiB measured on two machines) so the receive buffer stays in cache while
it is added. The sum of segment j is always formed as
x_{j+n-1} + (... + (x_{j+1} + x_j)): a fixed order, independent of timing, so the
result is bit-identical from run to run and the same on every rank.

`PreparedAllreduce` is the same sum of one tensor set up once (persistent MPI
requests) and run many times, blocking or nonblocking (training.collectives.buckets
runs one for every gradient bucket).
"""
import atexit
import weakref

import numpy as np

from .waits import _mpi, as_buffer, in_mpi, is_polite, ring, wait

RING_THRESHOLD_BYTES = 256 * 1024   # conf/defaults.yaml strategies.allreduce.ring_threshold_kb
RING_CHUNK_BYTES = 1 << 20          # measured best of 64 KiB..4 MiB (benchmarks/README.md)
ALGORITHMS = ("auto", "mpi", "ring")
_TAG = 7311                         # point-to-point tag of ring messages


def _segments(n_elems, n):
    """Bounds of the n ring segments: segment i is [b[i], b[i+1]), sizes differ by <= 1."""
    return [n_elems * i // n for i in range(n + 1)]


def _ring_exchanges(buf, rank, size, chunk_elems, tmp):
    """The ring all-reduce of `buf` as a list of exchanges (send, recv, add_into).

    For each exchange in order: send `send` to rank+1, receive `recv` from rank-1,
    then, in the reduce-scatter, add what arrived into `add_into` (own + received, a
    fixed order); in the all-gather `recv` is the destination itself (add_into None).
    """
    b = _segments(buf.size, size)
    out = []
    for s in range(size - 1):                       # reduce-scatter
        si, ri = (rank - s) % size, (rank - s - 1) % size
        send, mine = buf[b[si]:b[si + 1]], buf[b[ri]:b[ri + 1]]
        for off in range(0, max(send.size, mine.size, 1), chunk_elems):
            sc, mc = send[off:off + chunk_elems], mine[off:off + chunk_elems]
            out.append((sc, tmp[:mc.size], mc))
    for s in range(size - 1):                       # all-gather
        si, ri = (rank + 1 - s) % size, (rank - s) % size
        out.append((buf[b[si]:b[si + 1]], buf[b[ri]:b[ri + 1]], None))
    return out


def choose_algorithm(nbytes, algorithm="auto", threshold_bytes=RING_THRESHOLD_BYTES):
    """'mpi' below `threshold_bytes`, 'ring' from it up (or the algorithm forced)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if algorithm != "auto":
        return algorithm
    return "ring" if nbytes >= threshold_bytes else "mpi"


def _workspace(workspace, dtype, chunk_elems):
    if workspace is not None and workspace.dtype == dtype and workspace.size >= chunk_elems:
        return workspace
    return np.empty(chunk_elems, dtype)


def allreduce_(x, comm, algorithm="auto", threshold_bytes=RING_THRESHOLD_BYTES,
               chunk_bytes=RING_CHUNK_BYTES, workspace=None):
    """x_r <- sum_q x_q on every rank r of `comm`, in place, blocking; returns x.

    algorithm: 'mpi' (MPI_Allreduce), 'ring' (module docstring) or 'auto' (ring for
    messages of at least `threshold_bytes`). Any world size, any element count.
    `workspace`: an optional numpy array of at least chunk_bytes for the ring to
    receive into (else one is allocated per call). A tensor reduced again and
    again is reduced faster by a `PreparedAllreduce`.
    """
    buf = as_buffer(x)
    if buf.size == 0:
        return x
    alg = choose_algorithm(buf.nbytes, algorithm, threshold_bytes)
    mpi = _mpi()
    if alg == "mpi":
        comm.Allreduce(mpi.IN_PLACE, buf, mpi.SUM)
        return x
    size = comm.Get_size()
    if size == 1:
        return x
    chunk = max(1, chunk_bytes // buf.itemsize)
    rank = comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    for send, recv, add_into in _ring_exchanges(buf, rank, size, chunk,
                                                _workspace(workspace, buf.dtype, chunk)):
        comm.Sendrecv(send, right, _TAG, recv, left, _TAG)
        if add_into is not None:
            np.add(add_into, recv, out=add_into)
    return x


class PreparedAllreduce:
    """The in-place sum of one tensor over `comm`, set up once and run many times.

    Creating it is collective (every rank of `comm` creates the same ones in the same
    order). It holds persistent MPI requests: MPI_Allreduce_init below the
    threshold, or one MPI_Send_init/MPI_Recv_init pair per ring exchange, so a run
    pays no buffer or algorithm setup (about 2 us less than MPI_Allreduce per small
    call with mpi4py). Run it blocking (`run()`) or as `start()` then `test()` (never
    blocks; progresses) and `wait()`. Only one run may be in flight; `free()` (or
    leaving the interpreter) releases the requests.

    The tensor must stay alive and in place while the object exists; its contents
    may change freely between runs.
    """

    def __init__(self, x, comm, algorithm="auto", threshold_bytes=RING_THRESHOLD_BYTES,
                 chunk_bytes=RING_CHUNK_BYTES, workspace=None):
        mpi = _mpi()
        self.tensor = x
        self.buf = buf = as_buffer(x)
        self.comm = comm
        self.algorithm = choose_algorithm(buf.nbytes, algorithm, threshold_bytes)
        self._coll = None
        self._pairs = []          # [(requests [recv, send], add_into, recv view)]
        self._i = None            # next exchange to finish while running; None when idle
        self._flagged = False     # started: this rank counts as in MPI until it is done (waits.in_mpi)
        if buf.size == 0:
            pass
        elif self.algorithm == "mpi":
            self._coll = comm.Allreduce_init(mpi.IN_PLACE, buf, mpi.SUM)
        elif comm.Get_size() > 1:
            size, rank = comm.Get_size(), comm.Get_rank()
            right, left = (rank + 1) % size, (rank - 1) % size
            chunk = max(1, chunk_bytes // buf.itemsize)
            tmp = _workspace(workspace, buf.dtype, chunk)
            for send, recv, add_into in _ring_exchanges(buf, rank, size, chunk, tmp):
                reqs = [comm.Recv_init(recv, left, _TAG), comm.Send_init(send, right, _TAG)]
                self._pairs.append((reqs, add_into, recv))
        _track(self)

    @property
    def nbytes(self):
        return self.buf.nbytes

    def run(self):
        """Reduce now (blocking)."""
        if self._i is not None:
            raise RuntimeError("PreparedAllreduce.run() while a start() is still in flight")
        if self._coll is not None:      # (the plain Wait inline: this runs in microseconds)
            self._coll.Start()
            with in_mpi:
                self._coll.Wait() if not is_polite() else wait(self._coll)
            return
        mpi = _mpi()
        waitall = mpi.Request.Waitall if not is_polite() else wait
        for reqs, add_into, recv in self._pairs:
            mpi.Prequest.Startall(reqs)
            with in_mpi:
                waitall(reqs)
            if add_into is not None:
                np.add(add_into, recv, out=add_into)

    def start(self):
        """Begin reducing; the buffer must not be touched until test()/wait() say done."""
        if self._i is not None:
            raise RuntimeError("PreparedAllreduce.start() while the previous run is in flight")
        self._i = 0
        if self._coll is not None:
            self._coll.Start()
        elif self._pairs:
            _mpi().Prequest.Startall(self._pairs[0][0])
        else:
            self._i = None
        if self._i is not None:   # in flight, progressed by test(): in MPI for the polite ranks' waits
            self._flagged = True
            in_mpi.enter()

    def test(self):
        """Progress without blocking; True once the sum is in the buffer."""
        if self._i is None:
            return True
        mpi = _mpi()
        if self._coll is not None:
            if self._coll.Test():
                self._finished()
                return True
            return False
        while True:
            reqs, add_into, recv = self._pairs[self._i]
            if not mpi.Request.Testall(reqs):
                return False
            self._finish_exchange(add_into, recv)
            if self._i is None:
                return True

    def wait(self):
        """Block until the sum is in the buffer."""
        if self._i is None:
            return
        if self._coll is not None:
            with in_mpi:
                self._coll.Wait() if not is_polite() else wait(self._coll)
            self._finished()
            return
        waitall = _mpi().Request.Waitall if not is_polite() else wait
        while self._i is not None:
            reqs, add_into, recv = self._pairs[self._i]
            with in_mpi:
                waitall(reqs)
            self._finish_exchange(add_into, recv)

    def _finish_exchange(self, add_into, recv):
        if add_into is not None:
            np.add(add_into, recv, out=add_into)
        self._i += 1
        if self._i == len(self._pairs):
            self._finished()
        else:
            _mpi().Prequest.Startall(self._pairs[self._i][0])
            ring()

    def _finished(self):
        self._i = None
        if self._flagged:
            self._flagged = False
            in_mpi.leave()

    def free(self):
        """Release the persistent requests (idempotent)."""
        mpi = _mpi()
        if self._coll is not None:
            if self._i is not None:
                self._coll.Wait()
            self._coll.Free()
            self._coll = None
        for reqs, _, _ in self._pairs:
            for r in reqs:
                if r != mpi.REQUEST_NULL:
                    r.Free()
        self._pairs = []
        self._finished()
        _live.discard(self)



_live = weakref.WeakSet()   # PreparedAllreduce objects whose requests are not yet freed
_cleanup = []


def _track(p):
    if not _cleanup:
        # Registered after mpi4py's own MPI_Finalize (MPI is imported by now), so it runs
        # before it (atexit is last-in first-out) and MPI does not warn about persistent
        # requests that nobody freed.
        atexit.register(_free_live)
        _cleanup.append(True)
    _live.add(p)


def _free_live():
    MPI = _mpi()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for p in list(_live):
            if p._i is not None:        # in flight: waiting could hang on a dead peer
                continue
            try:
                p.free()
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                pass
