"""The partitioned forward and backward of hypergraph model parallelism: the exchanges
between layers and each rank's share of the model (see training.strategies.hypergraph.strategy
for the math).
"""
import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F

from training.collectives import mpi_datatype, wait

ROOT = 0


@dataclasses.dataclass
class Boundary:
    """What crosses the ranks between layer l and layer l+1, for this rank.

    own[r]        sorted unit indices of layer l on rank r
    consumer      whether this rank holds units of layer l+1 (it assembles A_l)
    dense         whether it needs every unit of A_l
    local         (positions in own block, unit indices) of own units it reads itself
    send[s]       positions in this rank's own block that rank s reads (s ≠ this rank)
    recv[q]       unit indices of rank q's block that this rank reads (q ≠ this rank)
    """
    units: int
    unit_shape: tuple
    own: list
    consumer: bool
    dense: bool
    local: tuple
    send: list
    recv: list


def _boundaries(chain, parts, rank, k):
    """One Boundary per layer except the loss (see Boundary), from the partition `parts`."""
    off = chain.offsets
    out = []
    for l, layer in enumerate(chain.layers[:-1]):
        p = parts[off[l]:off[l] + layer.units]
        q = parts[off[l + 1]:off[l + 1] + chain.layers[l + 1].units]
        own = [np.flatnonzero(p == r) for r in range(k)]
        needs = []
        for s in range(k):
            mine = np.flatnonzero(q == s)
            if len(mine) == 0:
                needs.append(np.zeros(0, dtype=np.int64))
            elif chain.dense_boundary(l):
                needs.append(np.arange(layer.units))
            else:
                need = np.zeros(layer.units, dtype=bool)
                for u in range(layer.units):
                    need[u] = any(v in chain.consumers(l, u) for v in mine)
                needs.append(np.flatnonzero(need))
        mine = own[rank]
        send = [np.zeros(0, dtype=np.int64) if s == rank else np.flatnonzero(np.isin(mine, needs[s]))
                for s in range(k)]
        recv = [np.zeros(0, dtype=np.int64) if r == rank else own[r][np.isin(own[r], needs[rank])]
                for r in range(k)]
        local_units = mine[np.isin(mine, needs[rank])]
        local = (np.searchsorted(mine, local_units), local_units)
        out.append(Boundary(units=layer.units, unit_shape=tuple(layer.out_shape[1:]), own=own,
                            consumer=len(needs[rank]) > 0, dense=len(needs[rank]) == layer.units,
                            local=local, send=send, recv=recv))
    return out


class Counters:
    """Bytes this rank sent and seconds it spent in exchanges since the last reset()."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.sent_bytes = 0
        self.comm_s = 0.0


def _alltoallv(comm, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, dtype, counters):
    t0 = time.perf_counter()
    mtype = mpi_datatype(dtype)
    wait(comm.Ialltoallv([sendbuf.numpy(), (scounts, sdispls), mtype],     # polite where throttled
                         [recvbuf.numpy(), (rcounts, rdispls), mtype]))
    counters.comm_s += time.perf_counter() - t0
    counters.sent_bytes += int(sum(scounts)) * sendbuf.element_size()


def _index(idx, device):
    return torch.as_tensor(idx, dtype=torch.long, device=device)


class _Exchange(torch.autograd.Function):
    """forward: A_l assembled on every consumer rank (own block + the blocks it reads from the
    others, one Alltoallv); an empty stand-in elsewhere.
    backward: the reverse Alltoallv; d(own block) = own share + Σ_s (rank s's share), in rank order.
    `token` (the previous exchange's output) only chains the exchanges in autograd."""

    @staticmethod
    def forward(ctx, own, token, b, comm, counters):
        ctx.b, ctx.comm, ctx.counters = b, comm, counters
        ctx.own_shape, ctx.device = tuple(own.shape), own.device
        k = comm.Get_size()
        n = own.shape[0]
        plane = n * int(np.prod(b.unit_shape, dtype=np.int64))
        host = own.detach().contiguous().cpu()
        everything = [len(s) == host.shape[1] for s in b.send]
        if all(e or len(s) == 0 for e, s in zip(everything, b.send)):
            sendbuf = host.reshape(-1)                        # every reader takes the whole block
            scounts = [plane * len(s) for s in b.send]
            sdispls = [0] * k
        else:
            pieces = [host.index_select(1, _index(s, "cpu")).reshape(-1) for s in b.send]
            sendbuf = torch.cat(pieces) if pieces else host.new_zeros(0)
            scounts = [plane * len(s) for s in b.send]
            sdispls = [int(v) for v in np.cumsum([0] + scounts[:-1])]
        rcounts = [plane * len(r) for r in b.recv]
        rdispls = [int(v) for v in np.cumsum([0] + rcounts[:-1])]
        recvbuf = host.new_empty(sum(rcounts))
        _alltoallv(comm, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, host.dtype, counters)
        if not b.consumer:
            return own.new_zeros(0)
        full = (torch.empty if b.dense else torch.zeros)((n, b.units, *b.unit_shape), dtype=host.dtype)
        pos, units = b.local
        if len(units):
            full.index_copy_(1, _index(units, "cpu"), host.index_select(1, _index(pos, "cpu")))
        for q in range(k):
            if len(b.recv[q]):
                block = recvbuf[rdispls[q]:rdispls[q] + rcounts[q]].view(n, len(b.recv[q]), *b.unit_shape)
                full.index_copy_(1, _index(b.recv[q], "cpu"), block)
        return full.to(own.device)

    @staticmethod
    def backward(ctx, grad):
        b, comm, counters = ctx.b, ctx.comm, ctx.counters
        k = comm.Get_size()
        n = ctx.own_shape[0]
        plane = n * int(np.prod(b.unit_shape, dtype=np.int64))
        dtype = grad.dtype
        d_own = torch.zeros(ctx.own_shape, dtype=dtype)
        if b.consumer:
            g = grad.detach().contiguous().cpu()
            pos, units = b.local
            if len(units):
                d_own.index_add_(1, _index(pos, "cpu"), g.index_select(1, _index(units, "cpu")))
            pieces = [g.index_select(1, _index(r, "cpu")).reshape(-1) for r in b.recv]
            sendbuf = torch.cat(pieces)
        else:
            sendbuf = torch.zeros(0, dtype=dtype)
        scounts = [plane * len(r) for r in b.recv]
        sdispls = [int(v) for v in np.cumsum([0] + scounts[:-1])]
        rcounts = [plane * len(s) for s in b.send]
        rdispls = [int(v) for v in np.cumsum([0] + rcounts[:-1])]
        recvbuf = torch.empty(sum(rcounts), dtype=dtype)
        _alltoallv(comm, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, dtype, counters)
        for s in range(k):
            if len(b.send[s]):
                block = recvbuf[rdispls[s]:rdispls[s] + rcounts[s]].view(n, len(b.send[s]), *b.unit_shape)
                d_own.index_add_(1, _index(b.send[s], "cpu"), block)
        return d_own.to(ctx.device), None, None, None, None


@dataclasses.dataclass
class _LayerGeometry:
    """What a rank needs to compute its units of one layer (no reference to the model)."""
    name: str
    kind: str
    groups: int = 1
    in_channels: int = 0
    stride: tuple = (1, 1)
    padding: object = (0, 0)
    dilation: tuple = (1, 1)


class PartitionedModel(torch.nn.Module):
    """This rank's share of a partitioned model: the weights of its units, and the forward
    pass of the whole world (module docstring). Every rank calls `loss(x, y)` on the same
    batch, in the same order; it returns (L, logits) on the loss rank, (None, token)
    elsewhere; `backward(result)` then runs the backward exchanges on every rank."""

    def __init__(self, chain, parts, comm, model=None, device="cpu"):
        super().__init__()
        self.comm, self.rank, self.k = comm, comm.Get_rank(), comm.Get_size()
        self.chain, self.parts = chain, np.asarray(parts, dtype=np.int64)
        self.device = torch.device(device)
        self.counters = Counters()
        self.boundaries = _boundaries(chain, self.parts, self.rank, self.k)
        off = chain.offsets
        self.loss_rank = int(self.parts[off[-1]])
        self.geometry, self.own = [], []
        for l, layer in enumerate(chain.layers[:-1]):
            idx = np.flatnonzero(self.parts[off[l]:off[l] + layer.units] == self.rank)
            self.own.append(idx)
            m = layer.module
            if layer.kind == "conv":
                self.geometry.append(_LayerGeometry(layer.name, "conv", m.groups, m.in_channels, tuple(m.stride),
                                                    m.padding, tuple(m.dilation)))
            else:
                self.geometry.append(_LayerGeometry(layer.name, "linear"))
            rows = _index(idx, m.weight.device)
            self.register_parameter(f"weight{l}", torch.nn.Parameter(m.weight.detach()[rows].clone().to(self.device)))
            self.register_parameter(f"bias{l}", None if m.bias is None else
                                    torch.nn.Parameter(m.bias.detach()[rows].clone().to(self.device)))

    def weight(self, l):
        """This rank's rows W_l[U_l(r)] of layer l's weight."""
        return getattr(self, f"weight{l}")

    def bias(self, l):
        return getattr(self, f"bias{l}")

    # -- the units of one layer --------------------------------------------------------

    def _compute(self, l, inp):
        g, w, b, idx = self.geometry[l], self.weight(l), self.bias(l), self.own[l]
        if g.kind == "linear":
            return F.linear(inp, w, b)
        if g.groups == 1:
            return F.conv2d(inp, w, b, g.stride, g.padding, g.dilation)
        units = self.chain.layers[l].units
        per_out, per_in = units // g.groups, g.in_channels // g.groups
        outs, start = [], 0
        for grp in np.unique(idx // per_out):                   # own channels, group by group
            count = int(np.count_nonzero(idx // per_out == grp))
            x = inp[:, grp * per_in:(grp + 1) * per_in]
            bias = b[start:start + count] if b is not None else None
            outs.append(F.conv2d(x, w[start:start + count], bias, g.stride, g.padding, g.dilation))
            start += count
        return torch.cat(outs, dim=1)

    def forward(self, x):
        """Run the world's forward pass; the loss rank gets the logits, the others a stand-in."""
        h = x
        token = torch.zeros(0, device=self.device, requires_grad=torch.is_grad_enabled())
        for l, layer in enumerate(self.chain.layers[:-1]):
            if len(self.own[l]):
                inp = h
                for op in layer.pre:
                    inp = op(inp)
                y = self._compute(l, inp)
                for op in layer.post:
                    y = op(y)
            else:
                y = torch.zeros((x.shape[0], 0, *layer.out_shape[1:]), dtype=x.dtype, device=self.device)
            h = _Exchange.apply(y, token, self.boundaries[l], self.comm, self.counters)
            token = h
        if self.rank != self.loss_rank:
            return h
        for op in self.chain.layers[-1].pre:
            h = op(h)
        return h

    def export_into(self, model):
        """Collective: the full weights, gathered at rank 0 into `model`'s layers (rank 0)."""
        modules = dict(model.named_modules()) if model is not None else {}
        for l, layer in enumerate(self.chain.layers[:-1]):
            w = self.weight(l).detach().cpu()
            b = self.bias(l).detach().cpu() if self.bias(l) is not None else None
            every = self.comm.gather((self.own[l], w, b), root=ROOT)
            if self.rank != ROOT:
                continue
            m = modules[layer.name]
            with torch.no_grad():
                for idx, wr, br in every:
                    if len(idx):
                        m.weight[_index(idx, m.weight.device)] = wr.to(m.weight.device)
                        if br is not None:
                            m.bias[_index(idx, m.bias.device)] = br.to(m.bias.device)
        return model
