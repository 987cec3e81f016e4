"""Gradients summed over the ranks while backward still runs (data parallelism).

Gradients are packed, in reverse parameter order, into flat buckets of `bucket_mb`;
the post-accumulate-grad hook of the last parameter of a bucket starts its reduction
(a PreparedAllreduce per bucket). Rank r contributes w_r * g_r, so the reduced
gradient is sum_r w_r g_r (with w_r = n_r / B this is the gradient of the mean loss
over a global batch of B = sum_r n_r rows split n_r per rank).
"""
import logging
import queue
import threading
import time

import numpy as np
import torch

from training import cputime

from . import shm
from .ring import RING_CHUNK_BYTES, PreparedAllreduce
from .waits import _mpi, as_buffer

log = logging.getLogger(__name__)

OVERLAP_MODES = ("poll", "thread", "none")


class _Bucket:
    """Consecutive parameters (reverse order) whose gradients share one flat buffer.

    On a GPU the gradients live in `dev` (on the device; p.grad views it) and are staged
    through `flat` (pinned host memory, what MPI reduces): each is copied when backward
    produces it, asynchronously on the compute stream, and `copied` (a CUDA event) tells
    when the bucket's copies are done; the sum is copied back after the reduction.
    """
    __slots__ = ("index", "params", "offsets", "flat", "dev", "copied", "pending", "ready", "op",
                 "started", "done")

    def __init__(self, index, params, dtype):
        self.index = index
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        device = params[0].device
        cuda = device.type == "cuda"
        self.flat = torch.zeros(n, dtype=dtype, pin_memory=cuda)
        self.dev = torch.zeros(n, dtype=dtype, device=device) if cuda else None
        self.copied = None
        self.pending = len(params)
        self.ready = [False] * len(params)
        self.op = None            # its PreparedAllreduce
        self.started = False
        self.done = None          # threading.Event (overlap='thread')

    def view(self, i, buf=None):
        p = self.params[i]
        buf = self.flat if buf is None else buf
        return buf[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def grad_view(self, i):
        """Where p.grad lives: the host buffer on the CPU, the device buffer on a GPU."""
        return self.view(i, self.dev)

    def staged(self, block=True):
        """Whether the bucket's gradients are in host memory (always, on the CPU); with
        block, wait until they are."""
        if self.copied is not None:
            if not block and not self.copied.query():
                return False
            self.copied.synchronize()
            self.copied = None
        return True


class GradientReducer:
    """Sums w_r * grad_r over the ranks of `comm`, overlapped with backward.

    For every trainable parameter p, after `begin(w)`, one backward and `finish()`:

        p.grad = sum_r w_r * dL_r/dp      (bit-identical on every rank)

    where L_r is the loss rank r backpropagated (its parameters on the CPU or on a GPU:
    see _Bucket for the staging through host memory). Parameters are packed in reverse
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
    is summed in a fixed order (ring, or MPI_Allreduce by size; when every rank is on
    this host the larger buckets live in shared memory and are summed there in the
    ring's order, training.collectives.shm), never depending on timing. Reductions run on a duplicate of `comm`, so they never match the caller's
    messages. Creating the reducer is collective over `comm`.
    """

    def __init__(self, params, comm, bucket_mb=4.0, ring_threshold_kb=256.0,
                 overlap="poll", chunk_bytes=RING_CHUNK_BYTES, shared_memory=True):
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
        # A world of one sums nothing: p.grad = w * grad where backward left it (on a GPU
        # no staging through host memory, so nothing waits for the device).
        self.alone = self.comm.Get_size() == 1
        self.params = [p for p in params if p.requires_grad]
        self.buckets = self._make_buckets(self.params, int(bucket_mb * (1 << 20)))
        self._where = {}
        self._arena = self._share(min(ring_threshold_kb * 1024, shm.THRESHOLD_BYTES), shared_memory)
        workspaces = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
            if b.op is not None:           # in shared memory
                continue
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

    def _share(self, threshold_bytes, enabled):
        """Place the buckets of at least `threshold_bytes` in shared memory when every rank
        is on this host (training.collectives.shm: the ring's sums, bit for bit, without the
        network module). Collective; a rank with a GPU keeps the ring (its buckets are
        staged through pinned memory)."""
        big = [b for b in self.buckets if b.flat.numel() * b.flat.element_size() >= threshold_bytes]
        nbytes = sum(-(-b.flat.numel() * b.flat.element_size() // 64) * 64 for b in big)
        cpu = all(b.dev is None for b in self.buckets)
        arena = shm.Arena.create(self.comm, nbytes, len(big), enabled=enabled and cpu)
        if arena is not None:
            for b in big:
                b.flat = arena.tensor(b.flat.numel(), b.flat.dtype)
                b.op = arena.allreduce(b.flat)
        return arena

    @staticmethod
    def _make_buckets(params, cap_bytes):
        buckets, cur, cur_bytes = [], [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if cur and (cur_bytes + nbytes > cap_bytes or p.dtype != cur[0].dtype or p.device != cur[0].device):
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
        with cputime.counting("hooks"):
            self._take_grad(p)

    def _take_grad(self, p):
        if not self._active:
            return
        b, i = self._where[id(p)]
        if b.ready[i]:
            raise RuntimeError("a parameter received two gradients in one step: call backward "
                               "once between GradientReducer.begin() and finish()")
        view = b.grad_view(i)
        if self._weight == 1.0:
            view.copy_(p.grad)
        else:
            torch.mul(p.grad, self._weight, out=view)
        p.grad = view
        b.ready[i] = True
        b.pending -= 1
        if self.alone:
            return
        if b.dev is not None and b.pending == 0:      # stage the whole bucket to host memory
            b.flat.copy_(b.dev, non_blocking=True)
            b.copied = torch.cuda.Event()
            b.copied.record()
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
                if not b.staged(block=False):      # the device is still copying it: later
                    break
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
                    b.staged()
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
                            view = b.grad_view(i)
                            view.zero_()
                            p.grad = view
                            b.ready[i] = True
                    b.pending = 0
                    if b.dev is not None and not self.alone:
                        b.flat.copy_(b.dev)
            if self.alone:
                return self._comm_s
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
                        b.staged()
                        b.op.start()
                        b.started = True
                    b.op.wait()
            else:
                for b in self.buckets:
                    b.staged()
                    b.op.run()
            for b in self.buckets:                  # a GPU's sums back where p.grad lives
                if b.dev is not None:
                    b.dev.copy_(b.flat, non_blocking=True)
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
        self.buckets, self._where = [], {}      # nothing views the shared memory: its mapping closes
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
