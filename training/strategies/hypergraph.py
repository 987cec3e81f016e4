"""Hypergraph-partitioned model parallelism (Eserol 2019) over an mpi4py communicator.

The model is traced into a chain of unit layers (training.partition.layer_chain: conv
output channels, linear neurons, the loss) and its hypergraph is partitioned onto the
ranks by Mt-KaHyPar in proportion to their capacities s_r (training.partition): unit v
goes to rank Π(v). Capacities: the strategy's `capacities` when given (one weight per
rank), else training.shares ('equal', 'vcores', 'speed': rows/s of forward + backward
measured on each rank, or a list). Rank 0 partitions; the parts are broadcast.

Who holds what: rank r holds the weights of its units only (rows W[Π_l^{-1}(r)] of
every conv and linear layer, and their biases), taken from rank 0's initial model, and
updates them with its own optimizer; nothing is replicated, nothing is synchronised.
Every rank reads the whole batch (batch_slice is (0, B) everywhere), so the data are
never sent.

Per layer l (A_l = the activation of layer l after its owner-side ops, U_l(r) the
units of layer l on rank r, R_{l+1} the ranks holding units of layer l+1):

    forward    rank r ∈ owners:  Y_l[:, U_l(r)] = post(op_l(pre(A_{l-1}), W_l[U_l(r)]))
               exchange:         rank q sends A_l[:, u] for u ∈ U_l(q) to every s ∈ R_{l+1},
                                 s ≠ q, whose units read u (one MPI_Alltoallv); each
                                 s ∈ R_{l+1} assembles the A_l it needs
    backward   rank s ∈ R_{l+1} has ∂L/∂A_l|_s = Σ_{v ∈ U_{l+1}(s)} (its units' share);
               it returns ∂L/∂A_l|_s[:, u] to Π(u) (the reverse MPI_Alltoallv), and
               Π(u) sums   ∂L/∂A_l[:, u] = Σ_s ∂L/∂A_l|_s[:, u]   (own share first, then
               rank order: a fixed order)
    the loss   on the rank that owns the loss unit: L = CE(logits, y), the mean over B;
               (L, correct) are broadcast for the step's statistics.

So a unit's activation of c bytes per sample crosses the network λ − 1 times forward
and λ − 1 times backward, λ the number of ranks holding it or a reader of it: exactly
the connectivity − 1 volume the partition minimised, 2·B·Σ_n (λ(n) − 1)·c(n) bytes per
step (counted in `sent_bytes`). Every unit's output and every weight gradient is the
single-process one up to float rounding (only the sums of dA over ranks are reordered).

Ordering: each exchange is an autograd Function of (own block, the previous exchange's
output) on every rank, so each rank's graph is one chain and the backward exchanges run
in the reverse order of the forward ones on every rank, including ranks that own
nothing of a layer (they receive an empty stand-in and still join the collective).
"""
import dataclasses
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

from training.collectives import mpi_datatype

from training.partition import (EPSILON, PartitionError, build_hypergraph, evaluate, hypergraph_partition,
                                layer_chain)

from .base import StepStats, Strategy

log = logging.getLogger(__name__)

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
    comm.Alltoallv([sendbuf.numpy(), (scounts, sdispls), mtype], [recvbuf.numpy(), (rcounts, rdispls), mtype])
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


class HypergraphStrategy(Strategy):
    """The strategy of the runner (see the module docstring); registry name "hypergraph"."""
    name = "hypergraph"

    def __init__(self, ctx, spec):
        super().__init__(ctx, spec)
        use_gpu = ctx.me.gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda") if use_gpu else torch.device("cpu")
        self.model = None          # rank 0: the full model (for export); elsewhere dropped once partitioned
        self.net = None            # PartitionedModel
        self.optimizer = None
        self.make_optimizer = None
        self.input_shape = None
        self.capacities = None
        self.predicted = None      # training.partition.evaluate of the partition
        self.split = None          # [rank] -> units held (logged to TensorBoard by the runner)
        self.layer_split = None    # layer name -> units per rank
        self.steps = 0

    # -- setup -------------------------------------------------------------------------

    def setup(self, model, make_optimizer):
        """Keep the model (rank 0's weights on every rank); the partition is made by the first
        train/eval step (the batch gives the input shape) or taken from a checkpoint."""
        self.model = model
        self.make_optimizer = make_optimizer
        self._broadcast_weights()

    def _broadcast_weights(self):
        """Rank 0's parameters to every rank, so every rank slices the same initial model."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for p in self.model.parameters():
                host = p.detach().contiguous().cpu()
                self.comm.Bcast([host.numpy(), mpi_datatype(host.dtype)], root=ROOT)
                p.copy_(host.to(p.device))

    def _capacities(self):
        caps, shares = self.config.capacities, self.spec.shares
        given = caps if caps is not None else (shares if isinstance(shares, (list, tuple)) else None)
        if given is not None:
            if len(given) != self.world_size:
                raise ValueError(f"hypergraph strategy: {len(given)} capacities for {self.world_size} ranks "
                                 "(training.strategy.capacities or training.shares); give one per rank")
            return [float(s) for s in given]
        if shares == "equal":
            return [1.0] * self.world_size
        if shares == "vcores":
            return [float(r.vcores) for r in self.ctx.ranks]
        from training.strategies.allreduce import SPEED_PROBE_ROWS, measure_speed
        gen = torch.Generator().manual_seed(self.rank)
        example = torch.randn((SPEED_PROBE_ROWS, *self.input_shape), generator=gen).to(self.device)
        speeds = self.comm.allgather(measure_speed(self.model.to(self.device), example))
        log.info("hypergraph: measured speeds (rows/s) %s", [round(s, 1) for s in speeds])
        return speeds

    def _partition(self, input_shape, parts=None):
        """Collective: trace the chain, partition it (rank 0; broadcast) unless `parts` is
        given, and keep this rank's units."""
        self.input_shape = tuple(int(s) for s in input_shape)
        chain = layer_chain(self.model, self.input_shape)
        drop = [op.name for layer in chain.layers for op in layer.pre + layer.post if op.dropout]
        if drop:
            raise PartitionError(f"hypergraph strategy: dropout ({drop}) would draw different masks on "
                                 "different ranks; remove it or set p=0")
        if parts is None:
            self.capacities = self._capacities()
            if self.rank == ROOT:
                hg = build_hypergraph(chain)
                parts, info = hypergraph_partition(hg, self.capacities, self.config.epsilon,
                                                         seed=self.spec.seed)
                self.predicted = evaluate(hg, parts, self.capacities)
                log.info("hypergraph: %d units onto capacities %s: %.0f bytes per sample (forward + "
                         "backward), imbalance %.3f, %.2f s", hg.num_vertices, self.capacities,
                         self.predicted["volume_bytes_per_sample"], self.predicted["imbalance"], info["seconds"])
            parts, self.predicted = self.comm.bcast((parts, self.predicted), root=ROOT)
        self.net = PartitionedModel(chain, parts, self.comm, self.model, self.device)
        off = chain.offsets
        for layer in chain.layers:
            layer.module = None                    # the slices are taken; hold no full weights
        self.split = [int(np.count_nonzero(self.net.parts == r)) for r in range(self.world_size)]
        self.layer_split = {layer.name: np.bincount(self.net.parts[off[l]:off[l] + layer.units],
                                                    minlength=self.world_size).tolist()
                            for l, layer in enumerate(chain.layers)}
        if self.rank != ROOT:
            self.model = None
        self.optimizer = self.make_optimizer(self._params())
        log.info("hypergraph rank %d: holds %s units per layer", self.rank,
                 {n: s[self.rank] for n, s in self.layer_split.items()})

    def _params(self):
        return [p for p in self.net.parameters()]

    def _ensure_partitioned(self, x):
        if self.net is None:
            shape = getattr(self.model, "input_shape", None) or tuple(x.shape[1:])
            self._partition(self.comm.bcast(tuple(shape) if self.rank == ROOT else None, root=ROOT))

    # -- steps -------------------------------------------------------------------------

    def batch_slice(self, global_batch):
        return 0, global_batch                   # every rank reads the whole batch

    def _finish(self, values):
        t0 = time.perf_counter()
        out = self.comm.bcast(values if self.rank == self.net.loss_rank else None, root=self.net.loss_rank)
        self.net.counters.comm_s += time.perf_counter() - t0
        return out

    def train_step(self, x, y):
        self._ensure_partitioned(x)
        t0 = time.perf_counter()
        self.net.counters.comm_s = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        x, y = x.to(self.device), y.to(self.device)
        out = self.net(x)
        if self.rank == self.net.loss_rank:
            loss = F.cross_entropy(out, y)
            loss.backward()
            values = [float(loss.detach()), int((out.detach().argmax(1) == y).sum()), len(y)]
        else:
            torch.autograd.backward([out], [torch.zeros_like(out)])
            values = None
        self.optimizer.step()
        loss_v, correct, n = self._finish(values)
        self.steps += 1
        comm_s = self.net.counters.comm_s
        return StepStats(loss=float(loss_v), correct=int(correct), samples=int(n),
                         compute_s=time.perf_counter() - t0 - comm_s, comm_s=comm_s)

    def eval_step(self, x, y):
        self._ensure_partitioned(x)
        with torch.no_grad():
            x, y = x.to(self.device), y.to(self.device)
            out = self.net(x)
        if self.rank != self.net.loss_rank:
            return 0.0, 0, 0
        return (float(F.cross_entropy(out, y, reduction="sum")), int((out.argmax(1) == y).sum()), len(y))

    # -- checkpoints and export --------------------------------------------------------

    def state_dict(self):
        return {"strategy": self.name, "rank": self.rank, "world_size": self.world_size,
                "input_shape": self.input_shape, "steps": self.steps,
                "parts": None if self.net is None else self.net.parts.tolist(),
                "model": None if self.net is None else self.net.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_state_dict(self, state):
        """Collective: every rank loads its own part (saved by the same rank of an equal world),
        keeping the checkpoint's partition."""
        if state.get("world_size") != self.world_size or state.get("rank") != self.rank:
            raise ValueError(f"hypergraph: checkpoint of rank {state.get('rank')} of {state.get('world_size')} "
                             f"cannot load on rank {self.rank} of {self.world_size}")
        if state["parts"] is None:
            return
        parts = np.asarray(state["parts"], dtype=np.int64)
        if self.net is None:
            self._partition(state["input_shape"], parts=parts)
        elif not np.array_equal(parts, self.net.parts):
            raise ValueError("hypergraph: the checkpoint was made with another partition; load it "
                             "before the first step")
        self.net.load_state_dict(state["model"])
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]

    def model_for_export(self):
        """Collective: the full trained model at rank 0 (its own copy, on the CPU)."""
        if self.net is None:
            return self.model if self.rank == ROOT else None
        import copy
        target = copy.deepcopy(self.model).cpu() if self.rank == ROOT else None
        return self.net.export_into(target)
