"""All-reduce for data parallelism: MPI buffers that are torch tensors, a ring, buckets.

Zero copy: a contiguous CPU tensor is handed to MPI as the numpy view of its own
memory (`as_buffer`), so nothing is packed or unpacked around a collective.

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
requests) and run many times, blocking or nonblocking; `GradientReducer` holds one
per bucket and reduces the gradients of a model while backward still runs:
gradients are packed, in reverse parameter order, into flat buckets of `bucket_mb`;
the post-accumulate-grad hook of the last parameter of a bucket starts its
reduction. Rank r contributes w_r * g_r, so the reduced gradient is sum_r w_r g_r
(with w_r = n_r / B this is the gradient of the mean loss over a global batch of
B = sum_r n_r rows split n_r per rank).
"""
import atexit
import logging
import queue
import threading
import time
import weakref

import numpy as np
import torch

log = logging.getLogger(__name__)

RING_THRESHOLD_BYTES = 256 * 1024   # conf/defaults.yaml training.allreduce.ring_threshold_kb
RING_CHUNK_BYTES = 1 << 20          # measured best of 64 KiB..4 MiB (benchmarks/README.md)
ALGORITHMS = ("auto", "mpi", "ring")
OVERLAP_MODES = ("poll", "thread", "none")
_TAG = 7311                         # point-to-point tag of ring messages
SPIN_S = 2e-4                       # a polite wait spins this long before it sleeps
MAX_PAUSE_S = 200e-6                # ... and then sleeps at most this long between tests

_polite = False


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


def wait(reqs, polite=None):
    """Complete one MPI request or a list of them.

    Not polite: MPI_Waitall (MPICH spins). Polite (the module setting, or `polite=True`):
    test for SPIN_S (while the peers are present, a pipelined transfer completes in this
    phase at full speed), then sleep between tests, 20 µs doubling up to MAX_PAUSE_S.
    """
    mpi = _mpi()
    many = isinstance(reqs, (list, tuple))
    if not (_polite if polite is None else polite):
        if many:
            mpi.Request.Waitall(reqs)
        else:
            reqs.Wait()
        return
    test = (lambda: mpi.Request.Testall(reqs)) if many else reqs.Test
    deadline = time.perf_counter() + SPIN_S
    while time.perf_counter() < deadline:
        if test():
            return
    pause = 20e-6
    while not test():
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)


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
        _live.add(self)

    @property
    def nbytes(self):
        return self.buf.nbytes

    def run(self):
        """Reduce now (blocking)."""
        if self._i is not None:
            raise RuntimeError("PreparedAllreduce.run() while a start() is still in flight")
        if self._coll is not None:      # (the plain Wait inline: this runs in microseconds)
            self._coll.Start()
            self._coll.Wait() if not _polite else wait(self._coll)
            return
        mpi = _mpi()
        waitall = mpi.Request.Waitall if not _polite else wait
        for reqs, add_into, recv in self._pairs:
            mpi.Prequest.Startall(reqs)
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

    def test(self):
        """Progress without blocking; True once the sum is in the buffer."""
        if self._i is None:
            return True
        mpi = _mpi()
        if self._coll is not None:
            if self._coll.Test():
                self._i = None
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
            self._coll.Wait() if not _polite else wait(self._coll)
            self._i = None
            return
        waitall = _mpi().Request.Waitall if not _polite else wait
        while self._i is not None:
            reqs, add_into, recv = self._pairs[self._i]
            waitall(reqs)
            self._finish_exchange(add_into, recv)

    def _finish_exchange(self, add_into, recv):
        if add_into is not None:
            np.add(add_into, recv, out=add_into)
        self._i += 1
        if self._i == len(self._pairs):
            self._i = None
        else:
            _mpi().Prequest.Startall(self._pairs[self._i][0])

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
        self._i = None
        _live.discard(self)


_live = weakref.WeakSet()   # PreparedAllreduce objects whose requests are not yet freed
_MPI = None


def _mpi():
    """mpi4py.MPI, imported on first use (importing it initialises MPI)."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI
        _MPI = MPI
        # Runs before mpi4py's own MPI_Finalize (atexit is last-in first-out), so MPI
        # does not warn about persistent requests that nobody freed.
        atexit.register(_free_live)
    return _MPI


def _free_live():
    if _MPI is not None and _MPI.Is_initialized() and not _MPI.Is_finalized():
        for p in list(_live):
            if p._i is not None:        # in flight: waiting could hang on a dead peer
                continue
            try:
                p.free()
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                pass


class _Bucket:
    """Consecutive parameters (reverse order) whose gradients share one flat buffer."""
    __slots__ = ("index", "params", "offsets", "flat", "pending", "ready", "op", "started",
                 "done")

    def __init__(self, index, params, dtype):
        self.index = index
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.flat = torch.zeros(n, dtype=dtype)
        self.pending = len(params)
        self.ready = [False] * len(params)
        self.op = None            # its PreparedAllreduce
        self.started = False
        self.done = None          # threading.Event (overlap='thread')

    def view(self, i):
        p = self.params[i]
        return self.flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class GradientReducer:
    """Sums w_r * grad_r over the ranks of `comm`, overlapped with backward.

    For every trainable parameter p, after `begin(w)`, one backward and `finish()`:

        p.grad = sum_r w_r * dL_r/dp      (bit-identical on every rank)

    where L_r is the loss rank r backpropagated. Parameters are packed in reverse
    order (the order backward produces their gradients) into flat buckets of at most
    `bucket_mb` MiB (a larger parameter gets a bucket of its own); the gradient hook
    copies w_r * grad into the bucket and makes p.grad a view of it. A bucket starts
    reducing as soon as all its gradients are in, strictly in bucket order (the same
    on every rank):

        overlap='poll'   nonblocking persistent MPI requests, progressed from every
                         gradient hook and completed in `finish()`; one thread, so it
                         steals no core from compute (the default: measured fastest
                         with one core per rank, see benchmarks/README.md);
        overlap='thread' a communication thread runs the blocking reductions
                         (needs MPI_THREAD_MULTIPLE, and a spare core to pay off);
        overlap='none'   every bucket is reduced in `finish()`, after backward.

    A parameter that got no gradient this step (unused in forward, or a rank with no
    rows) contributes zeros, so every rank takes part in every reduction. Each bucket
    is summed in a fixed order (ring, or MPI_Allreduce by size), never depending on
    timing. Reductions run on a duplicate of `comm`, so they never match the caller's
    messages. Creating the reducer is collective over `comm`.
    """

    def __init__(self, params, comm, bucket_mb=4.0, ring_threshold_kb=256.0,
                 overlap="poll", chunk_bytes=RING_CHUNK_BYTES):
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"unknown overlap mode {overlap!r}; choose one of {OVERLAP_MODES}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        mpi = _mpi()
        if overlap == "thread" and mpi.Query_thread() < mpi.THREAD_MULTIPLE:
            log.warning("MPI was initialised without MPI_THREAD_MULTIPLE: gradient reduction "
                        "uses overlap='poll' instead of 'thread'")
            overlap = "poll"
        self.comm = comm.Dup()
        self.overlap = overlap
        self.params = [p for p in params if p.requires_grad]
        self.buckets = self._make_buckets(self.params, int(bucket_mb * (1 << 20)))
        self._where = {}
        workspaces = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
            ws = workspaces.get(b.flat.dtype)
            if ws is None:
                ws = workspaces[b.flat.dtype] = np.empty(
                    max(1, chunk_bytes // b.flat.element_size()), dtype=as_buffer(b.flat).dtype)
            b.op = PreparedAllreduce(b.flat, self.comm, "auto", ring_threshold_kb * 1024,
                                     chunk_bytes, ws)
        self._weight = 1.0
        self._active = False
        self._next = 0            # first bucket not yet started
        self._comm_s = 0.0
        self._queue = None
        self._thread = None
        self._thread_error = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        log.debug("gradient reducer: %d parameters in %d buckets (%s), overlap=%s",
                  len(self.params), len(self.buckets),
                  ", ".join(f"{b.op.nbytes / 2**20:.2f} MiB {b.op.algorithm}" for b in self.buckets),
                  overlap)

    @staticmethod
    def _make_buckets(params, cap_bytes):
        buckets, cur, cur_bytes = [], [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if cur and (cur_bytes + nbytes > cap_bytes or p.dtype != cur[0].dtype):
                buckets.append(_Bucket(len(buckets), cur, cur[0].dtype))
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += nbytes
        if cur:
            buckets.append(_Bucket(len(buckets), cur, cur[0].dtype))
        return buckets

    # -- one step ---------------------------------------------------------------------

    def begin(self, weight):
        """Start a step whose gradients will be reduced with weight w_r = `weight`."""
        if self._active:
            raise RuntimeError("GradientReducer.begin() called twice without finish()")
        if self.comm is None:
            raise RuntimeError("GradientReducer is closed")
        self._weight = float(weight)
        self._active = True
        self._next = 0
        self._comm_s = 0.0
        for b in self.buckets:
            b.pending = len(b.params)
            b.ready = [False] * len(b.params)
            b.started = False
        for p in self.params:
            p.grad = None

    def _on_grad(self, p):
        if not self._active:
            return
        b, i = self._where[id(p)]
        if b.ready[i]:
            raise RuntimeError("a parameter received two gradients in one step: call backward "
                               "once between GradientReducer.begin() and finish()")
        view = b.view(i)
        if self._weight == 1.0:
            view.copy_(p.grad)
        else:
            torch.mul(p.grad, self._weight, out=view)
        p.grad = view
        b.ready[i] = True
        b.pending -= 1
        if b.pending == 0 and b.index == self._next:
            self._start_ready()
        elif self.overlap == "poll":
            self._poll()

    def _start_ready(self):
        """Start every complete bucket from the next in order (same order on all ranks)."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])
            self._next += 1
        if self.overlap == "poll":
            self._poll()

    def _start(self, b):
        if self.overlap == "thread":
            if self._thread is None:
                self._queue = queue.Queue()
                self._thread = threading.Thread(target=self._serve, name="grad-allreduce",
                                                daemon=True)
                self._thread.start()
            b.done = threading.Event()
            self._queue.put(b)
        # 'poll' starts buckets in _poll, one in flight at a time; 'none' in finish().

    def _poll(self):
        """Progress the started reductions without blocking, one in flight, in order."""
        t = time.perf_counter()
        for b in self.buckets[:self._next]:
            if not b.started:
                b.op.start()
                b.started = True
            if not b.op.test():
                break
        self._comm_s += time.perf_counter() - t

    def _serve(self):
        while True:
            b = self._queue.get()
            if b is None:
                return
            try:
                if self._thread_error is None:
                    b.op.run()
            except BaseException as e:  # noqa: BLE001 - re-raised by finish() on the training thread
                self._thread_error = e
            finally:
                b.done.set()

    def finish(self):
        """End the step: reduce what is left and wait for every bucket.

        Returns the seconds this thread spent in communication during the step
        (progressing or waiting). Afterwards every trainable p.grad holds
        sum_r w_r dL_r/dp.
        """
        if not self._active:
            raise RuntimeError("GradientReducer.finish() without begin()")
        t = time.perf_counter()
        try:
            for b in self.buckets:
                if b.pending:
                    for i, p in enumerate(b.params):
                        if not b.ready[i]:       # no gradient this step: contributes zeros
                            view = b.view(i)
                            view.zero_()
                            p.grad = view
                            b.ready[i] = True
                    b.pending = 0
            while self._next < len(self.buckets):
                self._start(self.buckets[self._next])
                self._next += 1
            if self.overlap == "thread":
                for b in self.buckets:
                    b.done.wait()
                if self._thread_error is not None:
                    err, self._thread_error = self._thread_error, None
                    raise RuntimeError("gradient all-reduce failed on the communication "
                                       "thread") from err
            elif self.overlap == "poll":
                for b in self.buckets:
                    if not b.started:
                        b.op.start()
                        b.started = True
                    b.op.wait()
            else:
                for b in self.buckets:
                    b.op.run()
        finally:
            self._active = False
        return self._comm_s + time.perf_counter() - t

    def close(self):
        """Remove the hooks, stop the thread, free the requests and the duplicate comm."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for b in self.buckets:
            if b.op is not None:
                b.op.free()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
