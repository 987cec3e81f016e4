"""The communication of conv-layer model parallelism, in autograd pairs (one function
each way, as fairscale/Megatron pair copy ↔ reduce and gather ↔ scatter):

    broadcast_from_master      forward Bcast      ↔ backward Reduce(SUM) to the master
    gather_channels_to_master  forward Gatherv    ↔ backward Scatterv of the channel slices
    allgather_channels         forward all-gather ↔ backward each rank's channels of every
                                                    rank's gradient, summed (both Alltoallw)
    row_parallel_linear        forward each rank's partial Linear output, Gather and sum at
                                                    the master ↔ backward Bcast of dZ

and the plain collectives that move kernel rows (gather_rows_to_master,
scatter_rows_from_master). Tensors go to and from MPI without copies: a CPU tensor is
handed to MPI as a NumPy view of its memory, and the channel slices of Gatherv and
Scatterv are described by MPI vector datatypes, so rank i's (N, c_i, H, W) block lands
directly in the (N, C, H, W) output and dY_i is read directly from dY. Tensors on a GPU
are staged through host memory (this MPI is not CUDA-aware).
"""
import dataclasses
import time

import numpy as np
import torch

from training import cputime
from training.collectives import mpi_datatype, wait

_DTYPES = (torch.float32, torch.float64)


def _mpi():
    from mpi4py import MPI
    return MPI

def _host(t):
    """A contiguous CPU tensor with t's values: t itself when it already is one (no copy)."""
    return t.detach().contiguous().cpu()


def _np(t):
    """The NumPy view of a contiguous CPU tensor's memory (zero-copy buffer for MPI)."""
    return t.numpy()


def offsets(split):
    """Start channel of every rank's slice: off_i = sum_{j<i} c_j."""
    return [int(v) for v in np.cumsum([0] + list(split[:-1]))]


@dataclasses.dataclass
class Timings:
    """Seconds spent by one layer (or the protocol) on this rank since the last reset()."""
    conv_s: float = 0.0      # local convolution, forward + backward
    conv_cpu_s: float = 0.0  # ... the process's CPU seconds in it
    comm_s: float = 0.0      # inside MPI calls (including waiting for the other ranks)

    def reset(self):
        self.conv_s = 0.0
        self.conv_cpu_s = 0.0
        self.comm_s = 0.0


class _Clock:
    """Adds the wall time of a `with` block to one field of a Timings (or to nothing), and
    its CPU time (the whole process's) to `cpu_field` when given."""

    def __init__(self, timings, field, cpu_field=None):
        self.timings, self.field, self.cpu_field = timings, field, cpu_field

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.cpu_field:
            self.c0 = time.process_time()

    def __exit__(self, *exc):
        if self.timings is not None:
            setattr(self.timings, self.field,
                    getattr(self.timings, self.field) + time.perf_counter() - self.t0)
            if self.cpu_field:
                setattr(self.timings, self.cpu_field,
                        getattr(self.timings, self.cpu_field) + time.process_time() - self.c0)


def _plane_type(mpi_type, samples, plane, channels):
    """MPI type of one channel plane of every sample of an (N, channels, plane) buffer.

    Its extent is one plane, so `count` consecutive copies starting at displacement j are
    the channels j .. j+count-1 of all N samples: the strided block a Gatherv/Scatterv
    moves for one rank, with no packing copy on our side.
    """
    vec = mpi_type.Create_vector(samples, plane, channels * plane)
    out = vec.Create_resized(0, plane * mpi_type.Get_size())
    vec.Free()
    out.Commit()
    return out


# ---------------------------------------------------------------------------------------
# Paired communication functions
# ---------------------------------------------------------------------------------------

class _BroadcastFromMaster(torch.autograd.Function):
    """forward: X_r = X_root on every rank r (MPI_Bcast).
    backward: dX_root = Σ_r dX_r (MPI_Reduce, SUM, at the root); other ranks get no gradient.
    The root broadcasts from x's own memory and reduces in place into the gradient it was
    handed: that gradient is the fresh dX_root of the one conv that consumed X, owned by
    nobody else.
    """

    @staticmethod
    def forward(ctx, x, comm, root, shape, dtype, device, timings):
        ctx.comm, ctx.root, ctx.timings = comm, root, timings
        mpi_type = mpi_datatype(dtype)
        if comm.Get_rank() == root:
            out = x.contiguous()
            host = _host(out)
        else:
            host = torch.empty(shape, dtype=dtype)
        with _Clock(timings, "comm_s"):
            wait(comm.Ibcast([_np(host), mpi_type], root=root))
        if comm.Get_rank() == root:
            return out
        return host.to(device)

    @staticmethod
    @cputime.counted("protocol")
    def backward(ctx, grad):
        comm, root = ctx.comm, ctx.root
        g = _host(grad)
        mpi_type = mpi_datatype(g.dtype)
        if comm.Get_rank() == root:
            with _Clock(ctx.timings, "comm_s"):
                wait(comm.Ireduce(_mpi().IN_PLACE, [_np(g), mpi_type], op=_mpi().SUM, root=root))
            return g.to(grad.device), None, None, None, None, None, None
        with _Clock(ctx.timings, "comm_s"):
            wait(comm.Ireduce([_np(g), mpi_type], None, op=_mpi().SUM, root=root))
        return None, None, None, None, None, None, None


def broadcast_from_master(x, comm, root=0, device=None, timings=None):
    """X on every rank = the root's x; backward: the root's dX = Σ_r dX_r (Reduce).

    Every rank calls it; x matters only on the root (pass None elsewhere). The root first
    broadcasts the shape, dtype and whether X needs a gradient (grad mode on and
    x.requires_grad), so the other ranks know what to receive and whether to take part
    in the backward Reduce; the result lands on `device` (default CPU) there.
    """
    MPI = _mpi()
    rank = comm.Get_rank()
    meta = np.zeros(9, dtype=np.int64)
    if rank == root:
        if x.dim() > 6:
            raise ValueError(f"broadcast_from_master: at most 6 dimensions, got {x.dim()}")
        meta[0] = int(torch.is_grad_enabled() and x.requires_grad)
        meta[1] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
        meta[2:2 + x.dim() + 1] = [x.dim(), *x.shape]
        if meta[1] < 0:
            mpi_datatype(x.dtype)  # raises the explanatory TypeError
    with _Clock(timings, "comm_s"):
        wait(comm.Ibcast([meta, MPI.INT64_T], root=root))
    needs_grad, dtype = bool(meta[0]), _DTYPES[int(meta[1])]
    shape = tuple(int(d) for d in meta[3:3 + int(meta[2])])
    if rank != root:
        device = torch.device(device or "cpu")
        # an empty stand-in that carries requires_grad, so backward reaches the Reduce
        x = torch.empty(0, dtype=dtype, device=device, requires_grad=needs_grad)
    else:
        device = x.device
        if not needs_grad:
            x = x.detach()
    return _BroadcastFromMaster.apply(x, comm, root, shape, dtype, device, timings)


class _GatherChannelsToMaster(torch.autograd.Function):
    """forward: Y = concat_r Y_r along dim 1 at the root (MPI_Gatherv); an empty tensor elsewhere.
    backward: dY_r = dY[:, off_r:off_r + c_r] (MPI_Scatterv from the root).
    The root's own block never goes through MPI (MPI_IN_PLACE): in forward it is copied
    once into Y (or is Y, when the root owns every channel); in backward it is a view of dY.
    """

    @staticmethod
    def forward(ctx, y, comm, counts, root, timings):
        ctx.comm, ctx.counts, ctx.root, ctx.timings = comm, counts, root, timings
        ctx.shape, ctx.device = tuple(y.shape), y.device
        n, c = y.shape[0], y.shape[1]
        plane = int(np.prod(y.shape[2:], dtype=np.int64))
        total, rank = sum(counts), comm.Get_rank()
        mpi_type = mpi_datatype(y.dtype)
        if rank != root:
            send_t = _plane_type(mpi_type, n, plane, c)
            try:
                with _Clock(timings, "comm_s"):
                    wait(comm.Igatherv([_np(_host(y)), c, send_t], None, root=root))
            finally:
                send_t.Free()
            return y.new_empty(0)
        if c == total:      # a copy: y may share its version counter with a fused chain's output
            out = _host(y).clone()
        else:
            out = torch.empty((n, total, *y.shape[2:]), dtype=y.dtype)
            off = offsets(counts)[rank]
            out[:, off:off + c].copy_(y)
        recv_t = _plane_type(mpi_type, n, plane, total)
        try:
            with _Clock(timings, "comm_s"):
                wait(comm.Igatherv(_mpi().IN_PLACE, [_np(out), (list(counts), offsets(counts)), recv_t], root=root))
        finally:
            recv_t.Free()
        return out.to(y.device)

    @staticmethod
    @cputime.counted("protocol")
    def backward(ctx, grad):
        comm, counts, root = ctx.comm, ctx.counts, ctx.root
        n, c = ctx.shape[0], ctx.shape[1]
        plane = int(np.prod(ctx.shape[2:], dtype=np.int64))
        mpi_type = mpi_datatype(grad.dtype)
        rank = comm.Get_rank()
        if rank == root:
            g = _host(grad)
            send_t = _plane_type(mpi_type, n, plane, sum(counts))
            try:
                with _Clock(ctx.timings, "comm_s"):
                    wait(comm.Iscatterv([_np(g), (list(counts), offsets(counts)), send_t], _mpi().IN_PLACE, root=root))
            finally:
                send_t.Free()
            off = offsets(counts)[rank]
            return grad[:, off:off + c], None, None, None, None
        mine = torch.empty(ctx.shape, dtype=grad.dtype)
        recv_t = _plane_type(mpi_type, n, plane, c)
        try:
            with _Clock(ctx.timings, "comm_s"):
                wait(comm.Iscatterv(None, [_np(mine), c, recv_t], root=root))
        finally:
            recv_t.Free()
        return mine.to(ctx.device), None, None, None, None


def gather_channels_to_master(y, comm, counts, root=0, timings=None):
    """Y = concat_r Y_r (dim 1) at the root, an empty tensor elsewhere; backward scatters dY.

    y is this rank's (N, c_r, ...) block; counts[r] = c_r for every rank (0 allowed).
    """
    if y.shape[1] != counts[comm.Get_rank()]:
        raise ValueError(f"gather_channels_to_master: rank {comm.Get_rank()} has {y.shape[1]} "
                         f"channels but counts says {counts[comm.Get_rank()]}")
    return _GatherChannelsToMaster.apply(y, comm, list(counts), root, timings)


class _AllgatherChannels(torch.autograd.Function):
    """forward: Y = concat_r Y_r along dim 1 on every rank: each rank sends its block to
    every other rank directly (MPI_Alltoallw with the strided plane types of Gatherv).
    Not MPI_Allgatherv: its ring and doubling algorithms forward blocks through third
    ranks, so a rank stopped by its CPU quota (or asleep in a polite wait) holds every
    transfer that passes through it (1 + 0.5 + 0.5 vcores, seed_cnn 32/96: 44–45 ms a
    step against 40–41 ms with direct sends, and 37–40 ms through the master).
    backward: every rank holds a gradient of the whole Y (its own conv's dX share);
    rank r gets Σ_q dY^(q)[:, off_r:off_r + c_r]: each rank sends every other rank that
    rank's channels (MPI_Alltoallw again), and the parts are summed in rank order, so
    the sum is the same on every run.
    """

    @staticmethod
    def forward(ctx, y, comm, counts, timings):
        ctx.comm, ctx.counts, ctx.timings, ctx.device = comm, counts, timings, y.device
        n, c = y.shape[0], y.shape[1]
        plane = int(np.prod(y.shape[2:], dtype=np.int64))
        rank, total = comm.Get_rank(), sum(counts)
        out = torch.empty((n, total, *y.shape[2:]), dtype=y.dtype)
        off = offsets(counts)[rank]
        out[:, off:off + c].copy_(y)
        mpi_type = mpi_datatype(y.dtype)
        size, item = comm.Get_size(), y.element_size()
        mine = _host(y)
        send_t = _plane_type(mpi_type, n, plane, c)
        recv_t = _plane_type(mpi_type, n, plane, total)
        try:
            send = [_np(mine), ([c * (q != rank) for q in range(size)], [0] * size), [send_t] * size]
            into = [_np(out), ([k * (q != rank) for q, k in enumerate(counts)],
                               [o * plane * item for o in offsets(counts)]), [recv_t] * size]
            with _Clock(timings, "comm_s"):
                wait(comm.Ialltoallw(send, into))
        finally:
            send_t.Free()
            recv_t.Free()
        return out.to(y.device)

    @staticmethod
    @cputime.counted("protocol")
    def backward(ctx, grad):
        comm, counts = ctx.comm, ctx.counts
        rank, size = comm.Get_rank(), comm.Get_size()
        g = _host(grad)
        n, total, c = g.shape[0], g.shape[1], counts[rank]
        plane = int(np.prod(g.shape[2:], dtype=np.int64))
        mpi_type = mpi_datatype(g.dtype)
        item = g.element_size()
        offs = offsets(counts)
        recv = torch.empty((size, n, c, *g.shape[2:]), dtype=g.dtype)
        send_t = _plane_type(mpi_type, n, plane, total)
        recv_t = _plane_type(mpi_type, n, plane, c)
        others = [q != rank for q in range(size)]
        try:
            send = [_np(g), ([counts[q] * o for q, o in enumerate(others)], [off * plane * item for off in offs]),
                    [send_t] * size]
            into = [_np(recv), ([c * o for o in others], [q * n * c * plane * item for q in range(size)]),
                    [recv_t] * size]
            with _Clock(ctx.timings, "comm_s"):
                wait(comm.Ialltoallw(send, into))
        finally:
            send_t.Free()
            recv_t.Free()
        mine = None
        for q in range(size):       # in rank order
            part = g[:, offs[rank]:offs[rank] + c] if q == rank else recv[q]
            if mine is None:
                mine = part.clone() if q == rank else part
            else:
                mine.add_(part)
        return mine.to(ctx.device), None, None, None


def allgather_channels(y, comm, counts, timings=None):
    """Y = concat_r Y_r (dim 1) on every rank; backward: each rank's channels of the sum of
    every rank's gradient. For two distributed convs in a row (a link): the second takes
    the first's whole output on every rank, so nothing goes through the master."""
    if y.shape[1] != counts[comm.Get_rank()]:
        raise ValueError(f"allgather_channels: rank {comm.Get_rank()} has {y.shape[1]} "
                         f"channels but counts says {counts[comm.Get_rank()]}")
    return _AllgatherChannels.apply(y, comm, list(counts), timings)


class _RowParallelLinear(torch.autograd.Function):
    """forward: Z = Σ_r Y_r W_r + b at the root, an empty tensor elsewhere: rank r
    multiplies its channels Y_r (N, c_r, H, W), flattened, by their rows W_r
    (c_r, H·W, out) of the Linear's weight, and the root gathers the (N, out) partials
    (MPI_Gather) and sums them in rank order, so the sum is the same on every run.
    backward: dZ from the root to every rank (MPI_Bcast); rank r computes
    dY_r = dZ W_rᵀ and dW_r = Y_rᵀ dZ, the root also db = Σ_n dZ.
    The products count as the rank's share (conv_s): they grow with its kernels."""

    @staticmethod
    def forward(ctx, y, weight, bias, comm, root, timings):
        ctx.comm, ctx.root, ctx.timings = comm, root, timings
        ctx.save_for_backward(y, weight)
        ctx.has_bias = bias is not None
        n, out_features = y.shape[0], weight.shape[2]
        features = weight.shape[0] * weight.shape[1]
        with cputime.counting("share"), _Clock(timings, "conv_s", "conv_cpu_s"):
            part = _host(y.reshape(n, features) @ weight.reshape(features, out_features))
        mpi_type = mpi_datatype(part.dtype)
        rank, size = comm.Get_rank(), comm.Get_size()
        if rank != root:
            with _Clock(timings, "comm_s"):
                wait(comm.Igather([_np(part), mpi_type], None, root=root))
            return y.new_empty(0)
        parts = torch.empty((size, n, out_features), dtype=part.dtype)
        with _Clock(timings, "comm_s"):
            wait(comm.Igather([_np(part), mpi_type], [_np(parts), mpi_type], root=root))
        z = parts[0].clone()
        for q in range(1, size):       # in rank order
            z.add_(parts[q])
        z = z.to(y.device)
        return z + bias if bias is not None else z

    @staticmethod
    @cputime.counted("protocol")
    def backward(ctx, grad):
        comm, root = ctx.comm, ctx.root
        y, weight = ctx.saved_tensors
        n, out_features = y.shape[0], weight.shape[2]
        is_root = comm.Get_rank() == root
        dz = _host(grad) if is_root else torch.empty((n, out_features), dtype=weight.dtype)
        with _Clock(ctx.timings, "comm_s"):
            wait(comm.Ibcast([_np(dz), mpi_datatype(dz.dtype)], root=root))
        dz = dz.to(weight.device)
        features = weight.shape[0] * weight.shape[1]
        w = weight.reshape(features, out_features)
        with cputime.counting("share"), _Clock(ctx.timings, "conv_s", "conv_cpu_s"):
            dy = (dz @ w.t()).view(y.shape) if ctx.needs_input_grad[0] else None
            dw = (y.reshape(n, features).t() @ dz).view(weight.shape) if ctx.needs_input_grad[1] else None
            db = dz.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dy, dw, db, None, None, None


def row_parallel_linear(y, weight, bias, comm, root=0, timings=None):
    """The Linear after a distributed conv, flattened (N, C·H·W) → (N, out), row-parallel:
    y is this rank's (N, c_r, H, W) channels, weight its rows (c_r, H·W, out) of the
    Linear's transposed weight, bias the Linear's bias on the root (None elsewhere).
    The root gets Z; the other ranks an empty tensor that stands for their part in
    autograd (backward on it receives dZ and computes their gradients)."""
    if y.shape[1] != weight.shape[0] or (y.shape[1] and y.shape[2:].numel() != weight.shape[1]):
        raise RuntimeError(f"conv_model_parallel: the Linear after this conv takes {weight.shape[1]} "
                           f"features per channel, but the conv's output has {tuple(y.shape[2:])} per channel")
    return _RowParallelLinear.apply(y, weight, bias, comm, root, timings)


def gather_rows_to_master(t, comm, counts, root=0):
    """concat_r t_r along dim 0 at the root (None elsewhere): full weights from shards."""
    t = _host(t)
    row = int(np.prod(t.shape[1:], dtype=np.int64))
    mpi_type = mpi_datatype(t.dtype)
    if comm.Get_rank() == root:
        out = torch.empty((sum(counts), *t.shape[1:]), dtype=t.dtype)
        comm.Gatherv([_np(t), mpi_type],
                     [_np(out), ([c * row for c in counts], [o * row for o in offsets(counts)]), mpi_type],
                     root=root)
        return out
    comm.Gatherv([_np(t), mpi_type], None, root=root)
    return None


def scatter_rows_from_master(full, comm, counts, row_shape, dtype, root=0):
    """This rank's rows [off_r, off_r + c_r) of the root's `full` (ignored elsewhere)."""
    row = int(np.prod(row_shape, dtype=np.int64))
    mpi_type = mpi_datatype(dtype)
    mine = torch.empty((counts[comm.Get_rank()], *row_shape), dtype=dtype)
    if comm.Get_rank() == root:
        full = _host(full)
        comm.Scatterv([_np(full), ([c * row for c in counts], [o * row for o in offsets(counts)]), mpi_type],
                      [_np(mine), mpi_type], root=root)
    else:
        comm.Scatterv(None, [_np(mine), mpi_type], root=root)
    return mine
