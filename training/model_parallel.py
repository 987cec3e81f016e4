"""Conv-layer model parallelism (Marques, Falcão, Alexandre 2018) over an mpi4py communicator.

Only the convolutions are distributed. With k ranks and a split (c_0, ..., c_{k-1}),
sum_i c_i = C (the layer's kernels), rank i owns the kernels [off_i, off_i + c_i):

    forward     X    = Bcast(X_master)                      (every rank: the same input)
                Y_i  = conv(X, W_i) + b_i                   (rank i: its c_i output channels)
                Y    = concat_i Y_i   (channel dim, Gatherv at the master)
    backward    dY_i = dY[:, off_i:off_i + c_i]             (Scatterv from the master)
                dW_i = X ⋆ dY_i,  db_i = Σ_{n,h,w} dY_i     (rank i, kept local: no weight sync)
                dX   = Σ_i dX_i,  dX_i = dY_i ⋆ᵀ W_i        (Reduce(SUM) at the master, only
                                                             where X needs a gradient)

Because the kernels of a convolution are independent, Y and dW equal the single-process
layer's exactly up to float rounding, and dX differs only by the order of one sum.

The communication comes in autograd pairs, one function each way (as fairscale/Megatron
pair copy ↔ reduce and gather ↔ scatter):
    broadcast_from_master      forward Bcast      ↔ backward Reduce(SUM) to the master
    gather_channels_to_master  forward Gatherv    ↔ backward Scatterv of the channel slices

Between distributed convs only the master runs the network (see `ShardProtocol`): the
other ranks hold nothing but their kernel shards and are told by the master, layer by
layer, when to run their share. Tensors go to and from MPI without copies: a CPU tensor
is handed to MPI as a NumPy view of its memory, and the channel slices of Gatherv and
Scatterv are described by MPI vector datatypes, so rank i's (N, c_i, H, W) block lands
directly in the (N, C, H, W) output and dY_i is read directly from dY. Tensors on a GPU
are staged through host memory (this MPI is not CUDA-aware).
"""
import dataclasses
import time

import numpy as np
import torch

from training.collectives import mpi_datatype, wait
import torch.nn as nn
import torch.nn.functional as F

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
    comm_s: float = 0.0      # inside MPI calls (including waiting for the other ranks)

    def reset(self):
        self.conv_s = 0.0
        self.comm_s = 0.0


class _Clock:
    """Adds the wall time of a `with` block to one field of a Timings (or to nothing)."""

    def __init__(self, timings, field):
        self.timings, self.field = timings, field

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.timings is not None:
            setattr(self.timings, self.field,
                    getattr(self.timings, self.field) + time.perf_counter() - self.t0)


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
        comm.Bcast([meta, MPI.INT64_T], root=root)
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
        if c == total:
            out = _host(y)
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


# ---------------------------------------------------------------------------------------
# The local share of a convolution
# ---------------------------------------------------------------------------------------

class _ShardConv2d(torch.autograd.Function):
    """Y_i = conv(X, W_i) + b_i, with explicit backward so its time can be measured:
    dX_i = convolution_backward(dY_i)[input], dW_i = X ⋆ dY_i, db_i = Σ dY_i — the very
    ATen call (aten.convolution_backward) autograd makes for nn.Conv2d. A rank with no
    kernels (c_i = 0) outputs (N, 0, H', W') and contributes dX_i = 0.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, geometry, timings):
        stride, padding, dilation = geometry
        ctx.geometry, ctx.timings, ctx.has_bias = geometry, timings, bias is not None
        ctx.save_for_backward(x, weight)
        with _Clock(timings, "conv_s"):
            if weight.shape[0] == 0:
                size = [(x.shape[2 + d] + 2 * padding[d] - dilation[d] * (weight.shape[2 + d] - 1) - 1)
                        // stride[d] + 1 for d in range(2)]
                return x.new_zeros((x.shape[0], 0, *size))
            y = F.conv2d(x, weight, bias, stride, padding, dilation)
            _sync(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        with _Clock(ctx.timings, "conv_s"):
            if weight.shape[0] == 0:
                gx = torch.zeros_like(x) if need_x else None
                gw = torch.zeros_like(weight) if need_w else None
                gb = weight.new_zeros(0) if need_b and ctx.has_bias else None
                return gx, gw, gb, None, None
            gx, gw, gb = torch.ops.aten.convolution_backward(
                grad.contiguous(), x, weight, [weight.shape[0]] if ctx.has_bias else None,
                list(stride), list(padding), list(dilation), False, [0, 0], 1,
                [bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)])
            _sync(gw if gw is not None else gx)
        return gx, gw, gb, None, None


def _sync(t):
    if t is not None and t.is_cuda:
        torch.cuda.synchronize(t.device)


def conv_padding(conv):
    """(pad_h, pad_w) of an nn.Conv2d's zero padding, also for 'valid' and 'same';
    None where 'same' would need asymmetric padding (an even kernel extent)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0)
        total = [conv.dilation[d] * (conv.kernel_size[d] - 1) for d in range(2)]
        return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)
    return tuple(conv.padding)


def why_not_distributable(conv):
    """None if DistributedConv2d can split `conv` by output channel, else the reason."""
    if not isinstance(conv, nn.Conv2d):
        return f"{type(conv).__name__} is not an nn.Conv2d"
    if conv.groups != 1:
        return f"grouped convolutions (groups={conv.groups}) cannot be split by output channel"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} is not supported, only 'zeros'"
    if conv_padding(conv) is None:
        return f"padding='same' with kernel {tuple(conv.kernel_size)} needs asymmetric padding"
    return None


class DistributedConv2d(nn.Module):
    """A Conv2d whose output channels are split over the ranks of `comm`.

        Y = concat_i conv(X, W_i) + b_i      W_i = W[off_i : off_i + split[i]]

    Rank i holds only W_i and b_i (sliced from `conv`, so it starts exactly where the
    single-process layer starts) and updates them with its own optimizer: no weight
    synchronisation is ever needed. Every rank calls forward in the same order; x is the
    input on the master (`root`) and ignored elsewhere (pass None). The master gets Y;
    the other ranks get an empty tensor that stands for their share in autograd, so
    calling backward on it (with an empty gradient) receives dY_i, computes dW_i, db_i
    and, where X needs a gradient, sends dX_i to the master's Reduce.

    split: one non-negative int per rank, summing to conv.out_channels. A rank with 0
    kernels computes nothing but still takes part in the collectives.
    """

    def __init__(self, conv, comm, split, root=0):
        super().__init__()
        reason = why_not_distributable(conv)
        if reason:
            raise ValueError(f"DistributedConv2d: {reason}; leave this layer undistributed")
        self.comm, self.root = comm, root
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride, self.dilation = tuple(conv.stride), tuple(conv.dilation)
        self.padding = conv_padding(conv)
        self.timings = Timings()
        self._set_split(split)
        lo, hi = self.offset, self.offset + self.count
        self.weight = nn.Parameter(conv.weight.detach()[lo:hi].clone())
        self.bias = nn.Parameter(conv.bias.detach()[lo:hi].clone()) if conv.bias is not None else None

    def _set_split(self, split):
        split = [int(s) for s in split]
        n = self.comm.Get_size()
        if len(split) != n:
            raise ValueError(f"DistributedConv2d: split has {len(split)} entries for {n} ranks")
        if any(s < 0 for s in split) or sum(split) != self.out_channels:
            raise ValueError(f"DistributedConv2d: split {split} must be non-negative and sum to "
                             f"the layer's {self.out_channels} kernels")
        self.split = split
        self.offset = offsets(split)[self.comm.Get_rank()]
        self.count = split[self.comm.Get_rank()]

    @property
    def is_master(self):
        return self.comm.Get_rank() == self.root

    def forward(self, x=None):
        x = broadcast_from_master(x, self.comm, self.root, device=self.weight.device,
                                  timings=self.timings)
        y = _ShardConv2d.apply(x, self.weight, self.bias, (self.stride, self.padding, self.dilation),
                               self.timings)
        return gather_channels_to_master(y, self.comm, self.split, self.root, self.timings)

    def load_from_master(self, conv=None):
        """Collective: every rank takes its slice of the master's `conv` (ignored elsewhere).

        Makes the shards independent of how each rank initialised its own copy.
        """
        with torch.no_grad():
            w = scatter_rows_from_master(conv.weight if self.is_master else None, self.comm, self.split,
                                         self.weight.shape[1:], self.weight.dtype, self.root)
            self.weight.copy_(w)
            if self.bias is not None:
                b = scatter_rows_from_master(conv.bias if self.is_master else None, self.comm,
                                             self.split, (), self.bias.dtype, self.root)
                self.bias.copy_(b)

    def gather_full(self, tensors=None):
        """Collective: the full (weight, bias) at the master, (None, None) elsewhere.

        tensors: this rank's (weight-shaped, bias-shaped-or-None) pair to assemble instead
        of the parameters, e.g. their gradients.
        """
        w, b = tensors if tensors is not None else (self.weight.detach(), self.bias)
        full_w = gather_rows_to_master(w, self.comm, self.split, self.root)
        full_b = gather_rows_to_master(b.detach(), self.comm, self.split, self.root) if b is not None else None
        return full_w, full_b

    def to_conv2d(self):
        """Collective: an ordinary nn.Conv2d with the full weights at the master (None elsewhere)."""
        w, b = self.gather_full()
        if not self.is_master:
            return None
        conv = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride,
                         self.padding, self.dilation, bias=b is not None)
        with torch.no_grad():
            conv.weight.copy_(w)
            if b is not None:
                conv.bias.copy_(b)
        return conv

    def reshard(self, split):
        """Collective: move to a new split, keeping the full layer unchanged.

        Returns (old_params, new_params) in the same order, so a caller can carry
        per-parameter state (an optimizer's) over with `redistribute`.
        """
        old_split = self.split
        old = [p for p in (self.weight, self.bias) if p is not None]
        self._set_split(split)
        new = [nn.Parameter(self.redistribute(p.detach(), old_split).to(p.device)) for p in old]
        self.weight = new[0]
        if self.bias is not None:
            self.bias = new[1]
        return old, new

    def redistribute(self, t, old_split):
        """Collective: this rank's rows of a per-kernel tensor under self.split, given its rows
        under old_split (gathered at the master, then scattered)."""
        full = gather_rows_to_master(t, self.comm, old_split, self.root)
        return scatter_rows_from_master(full, self.comm, self.split, t.shape[1:], t.dtype, self.root)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, split={self.split}, "
                f"rank={self.comm.Get_rank()} owns [{self.offset}, {self.offset + self.count})")


# ---------------------------------------------------------------------------------------
# Master-driven execution
# ---------------------------------------------------------------------------------------

class ShardProtocol:
    """The master runs the network; the other ranks serve their shards on command.

    Why only the master runs the layers between distributed convs (ReLU, pooling, the
    classifier), as in the paper: those layers then have one set of parameters, on one
    rank, updated once; the other ranks do no redundant work (on a slow rank, redundant
    work would stretch every step, which is what the speed-proportional split avoids);
    and the next conv's input, broadcast after pooling, is smaller than the pre-pooling
    feature map an all-gather would move. Exactness is kept because every rank's
    conv share runs on the very X the master computed.

    Protocol: before each distributed conv call the master broadcasts a command
    [FORWARD, layer, call, grad_mode]; the servers run that layer (`layer(None)`), which
    enters the same Bcast/Gatherv. In backward, right before a call's Scatterv, the master
    broadcasts [BACKWARD, layer, call] (an identity autograd function placed after the
    gather: its backward runs immediately before the gather's) and the servers run
    backward on that call's stand-in output, entering the same Scatterv and, where X
    needs a gradient, the same Reduce. The master ends a step with [END, payload] (e.g.
    loss and correct count), which returns from `serve()` on every server. Commands
    carry the call index, so any order of layer calls (reuse, branches, eval without
    backward) stays matched.
    """
    FORWARD, BACKWARD, END = 1.0, 2.0, 3.0
    _HEADER = 8

    def __init__(self, layers, comm, root=0):
        self.layers = list(layers)
        self.comm, self.root = comm, root
        self.timings = Timings()
        self._calls = 0
        self._current = {}       # layer index -> the call now running through it (master)
        self._handles = []
        if self.is_master:
            for index, layer in enumerate(self.layers):
                self._handles.append(layer.register_forward_pre_hook(self._before(index)))
                self._handles.append(layer.register_forward_hook(self._after(index)))

    @property
    def is_master(self):
        return self.comm.Get_rank() == self.root

    def detach(self):
        """Remove the master's hooks (the layers become plain SPMD layers again)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _send(self, header):
        with _Clock(self.timings, "comm_s"):
            wait(self.comm.Ibcast([header, _mpi().DOUBLE], root=self.root))

    def _before(self, index):
        def hook(module, args):
            call = self._current[index] = self._calls
            self._calls += 1
            self._send(np.array([self.FORWARD, index, call, float(torch.is_grad_enabled()), 0, 0, 0, 0]))
        return hook

    def _after(self, index):
        def hook(module, args, output):
            if output.requires_grad:
                return _AnnounceBackward.apply(output, self, index, self._current[index])
            return output
        return hook

    def finish(self, payload=()):
        """Master: end the step; the servers' `serve()` returns `payload` (≤ 7 floats)."""
        if len(payload) > self._HEADER - 1:
            raise ValueError(f"ShardProtocol.finish: at most {self._HEADER - 1} payload values")
        header = np.zeros(self._HEADER)
        header[0] = self.END
        header[1:1 + len(payload)] = payload
        self._send(header)
        self._calls = 0
        return np.array(payload, dtype=np.float64)

    def serve(self):
        """Servers: run this rank's shares until the master's END; returns its payload."""
        MPI = _mpi()
        calls = {}
        header = np.zeros(self._HEADER)
        while True:
            with _Clock(self.timings, "comm_s"):
                wait(self.comm.Ibcast([header, MPI.DOUBLE], root=self.root), polite=True)
            op, index, call = header[0], int(header[1]), int(header[2])
            if op == self.FORWARD:
                with torch.set_grad_enabled(bool(header[3])):
                    out = self.layers[index](None)
                if out.requires_grad:
                    calls[call] = out
            elif op == self.BACKWARD:
                out = calls.pop(call)
                torch.autograd.backward(out, torch.zeros_like(out))
            elif op == self.END:
                return header[1:].copy()
            else:
                raise RuntimeError(f"ShardProtocol: unknown command {header.tolist()} from the master")


class _AnnounceBackward(torch.autograd.Function):
    """Identity in forward; in backward the master tells the servers which call's
    backward comes next, then passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx, y, protocol, index, call):
        ctx.protocol, ctx.index, ctx.call = protocol, index, call
        return y

    @staticmethod
    def backward(ctx, grad):
        ctx.protocol._send(np.array([ShardProtocol.BACKWARD, ctx.index, ctx.call, 1, 0, 0, 0, 0]))
        return grad, None, None, None
