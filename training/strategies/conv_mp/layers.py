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

The communication comes in autograd pairs (training.strategies.conv_mp.comm):
Bcast X ↔ Reduce dX, Gatherv Y ↔ Scatterv dY; where one distributed conv feeds the
next alone (link_to), Y all-gathered ↔ each rank's channels of Σ_i dX_i (both by
Alltoallw, the sum in rank order), and the next conv's input is already on every rank.
Where the conv's output (after its chain) is flattened into a Linear alone (attach_head:
the classifier after the last conv), the Linear runs row-parallel: rank i multiplies
Y_i by its columns of the weight, the master sums the partial outputs (Gather) and adds the
bias ↔ dZ broadcast to every rank, and neither Y nor dY goes through the master.
Between distributed convs only the master runs the network
(training.strategies.conv_mp.protocol.ShardProtocol): the other ranks hold nothing but
their kernel shards and are told by the master, layer by layer, when to run their share.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from training import cputime

from .comm import (Timings, _Clock, allgather_channels, broadcast_from_master, gather_channels_to_master,
                   gather_rows_to_master, offsets, row_parallel_linear, scatter_rows_from_master)


class _ShardConv2d(torch.autograd.Function):
    """Y_i = chain(conv(X, W_i) + b_i), with explicit backward so its time can be measured:
    dX_i = convolution_backward(dY_i)[input], dW_i = X ⋆ dY_i, db_i = Σ dY_i — the very
    ATen call (aten.convolution_backward) autograd makes for nn.Conv2d. `chain`: the
    channel-wise layers fused after the conv (training.strategies.conv_mp.fuse), run on
    this rank's channels, their backward run first in backward. A rank with no kernels
    (c_i = 0) outputs (N, 0, H', W') and contributes dX_i = 0.
    """

    @staticmethod
    @cputime.counted("share")
    def forward(ctx, x, weight, bias, geometry, timings, followers=(), track=False):
        stride, padding, dilation = geometry
        ctx.geometry, ctx.timings, ctx.has_bias = geometry, timings, bias is not None
        ctx.save_for_backward(x, weight)
        ctx.chain, ctx.fused = None, bool(followers) and track
        with _Clock(timings, "conv_s", "conv_cpu_s"):
            if weight.shape[0] == 0:
                size = [(x.shape[2 + d] + 2 * padding[d] - dilation[d] * (weight.shape[2 + d] - 1) - 1)
                        // stride[d] + 1 for d in range(2)]
                if followers:   # pooling refuses 0 channels: the chain's output size from one
                    size = _chain(followers, x.new_zeros((1, 1, *size))).shape[2:]
                return x.new_zeros((x.shape[0], 0, *size))
            y = F.conv2d(x, weight, bias, stride, padding, dilation)
            if ctx.fused:                    # the chain's own graph, run back in backward
                with torch.enable_grad():
                    y0 = y.detach().requires_grad_(True)
                    z = _chain(followers, y0)
                ctx.chain = (y0, z)
                y = z.detach()
            elif followers:
                y = _chain(followers, y)
            _sync(y)
        return y

    @staticmethod
    @cputime.counted("share")
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None, None, None, None)
        with _Clock(ctx.timings, "conv_s", "conv_cpu_s"):
            if weight.shape[0] == 0:
                gx = torch.zeros_like(x) if need_x else None
                gw = torch.zeros_like(weight) if need_w else None
                gb = weight.new_zeros(0) if need_b and ctx.has_bias else None
                return (gx, gw, gb) + none
            if ctx.fused:                    # through the channel-wise layers first
                if ctx.chain is None:
                    raise RuntimeError("conv_model_parallel: a second backward through a layer whose "
                                       "activation/pooling run in the shards; set "
                                       "training.strategy.fuse: false to keep retain_graph working")
                y0, z = ctx.chain
                ctx.chain = None
                grad, = torch.autograd.grad(z, y0, grad)
            gx, gw, gb = torch.ops.aten.convolution_backward(
                grad.contiguous(), x, weight, [weight.shape[0]] if ctx.has_bias else None,
                list(stride), list(padding), list(dilation), False, [0, 0], 1,
                [bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)])
            _sync(gw if gw is not None else gx)
        return (gx, gw, gb) + none


def _chain(followers, y):
    for f in followers:
        y = f(y)
    return y


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
    followers: channel-wise modules (an activation, pooling) each rank applies to its own
    channels before the gather (training.strategies.conv_mp.fuse); Y is then their output.
    """

    def __init__(self, conv, comm, split, root=0, followers=()):
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
        self.followers = tuple(followers)   # not submodules: the model owns them (state_dict unchanged)
        self.feeds = None       # the distributed conv that takes this one's whole output (link_to)
        self.fed = False        # takes its input from the one before it on every rank
        self._linked_input = None
        self.head_weight = None     # attach_head: this rank's rows (c_i, H·W, out) of the Linear after it
        self.head_bias = None       # ... and the Linear's bias, on the master only
        self._set_split(split)
        lo, hi = self.offset, self.offset + self.count
        self.weight = nn.Parameter(conv.weight.detach()[lo:hi].clone(), requires_grad=conv.weight.requires_grad)
        self.bias = nn.Parameter(conv.bias.detach()[lo:hi].clone(), requires_grad=conv.bias.requires_grad) \
            if conv.bias is not None else None

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
        with cputime.counting("protocol"):
            return self._forward(x)

    def link_to(self, nxt):
        """Feed `nxt`, the next distributed conv, directly: this layer's output (after its
        chain) is all-gathered on every rank and is `nxt`'s input there, instead of going
        to the master in a Gatherv and back in a Bcast (backward: each rank's channels of
        the summed dX, instead of a Reduce at the master and a Scatterv). Only where the
        model feeds this layer's output to `nxt` alone, and nothing else in between."""
        object.__setattr__(self, "feeds", nxt)     # not a submodule: its parameters are its own
        nxt.fed = True

    def attach_head(self, linear):
        """Collective: run `linear` (nn.Linear, fed this layer's output after its chain,
        flattened) row-parallel (module docstring); this layer's output is then the
        Linear's, at the master. Every rank takes its columns of the master's `linear`
        (ignored elsewhere), the master its bias."""
        out_features, in_features = linear.weight.shape
        if in_features % self.out_channels:
            raise ValueError(f"DistributedConv2d: a Linear of {in_features} features does not take a whole "
                             f"number per channel of {self.out_channels}")
        full = None
        if self.is_master:   # (out, C·P) -> (C, P, out): a channel's weights are one row
            full = linear.weight.detach().view(out_features, self.out_channels, -1).permute(1, 2, 0)
        plane = in_features // self.out_channels
        with torch.no_grad():
            rows = scatter_rows_from_master(full, self.comm, self.split, (plane, out_features),
                                            linear.weight.dtype, self.root)
        self.head_weight = nn.Parameter(rows.to(self.weight.device), requires_grad=linear.weight.requires_grad)
        if self.is_master and linear.bias is not None:
            self.head_bias = nn.Parameter(linear.bias.detach().clone().to(self.weight.device),
                                          requires_grad=linear.bias.requires_grad)

    def to_linear(self):
        """Collective: the Linear after this layer (attach_head) as an ordinary nn.Linear
        with the full weight at the master (None elsewhere)."""
        rows = gather_rows_to_master(self.head_weight.detach(), self.comm, self.split, self.root)
        if not self.is_master:
            return None
        channels, plane, out_features = rows.shape
        in_features = channels * plane
        linear = nn.Linear(in_features, out_features, bias=self.head_bias is not None, dtype=rows.dtype)
        with torch.no_grad():
            linear.weight.copy_(rows.permute(2, 0, 1).reshape(out_features, in_features))
            if self.head_bias is not None:
                linear.bias.copy_(self.head_bias)
        return linear

    def _forward(self, x):
        if self.fed:            # the whole input is on every rank already (link_to)
            if not self.is_master:
                x, self._linked_input = self._linked_input, None
                if x is None:
                    raise RuntimeError("conv_model_parallel: a linked layer ran before the layer that feeds it")
        else:
            x = broadcast_from_master(x, self.comm, self.root, device=self.weight.device,
                                      timings=self.timings)
        y = _ShardConv2d.apply(x, self.weight, self.bias, (self.stride, self.padding, self.dilation),
                               self.timings, self.followers, torch.is_grad_enabled())
        if self.feeds is not None:
            y = allgather_channels(y, self.comm, self.split, self.timings)
            if not self.is_master:
                self.feeds._linked_input = y
            return y
        if self.head_weight is not None:
            return row_parallel_linear(y, self.head_weight, self.head_bias, self.comm, self.root, self.timings)
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
        names = [n for n in ("weight", "bias", "head_weight") if getattr(self, n) is not None]
        old = [getattr(self, n) for n in names]
        self._set_split(split)
        new = [nn.Parameter(self.redistribute(p.detach(), old_split).to(p.device), requires_grad=p.requires_grad)
               for p in old]
        for n, p in zip(names, new):
            setattr(self, n, p)
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
