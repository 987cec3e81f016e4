"""Parameter servers, for comparison with the ring (seed 3: Gebremeskel 2018; seed 4: Šlampa 2017).

Both are data parallel like `allreduce`: every rank holds the whole model, reads
n_r rows of each global batch of B = sum_r n_r rows (`shares`: equal, vcores,
speed or a list), backpropagates its local mean loss L_r and contributes

    g_r = (n_r / B) grad L_r,        g = sum_r g_r = grad (1/B) sum_{i in batch} loss_i,

so every update is the one a single process would make on the whole batch. What
differs from the ring is who sums g and who applies the optimizer. All trainable
parameters live in one flat vector W (every parameter is a view into it), |W|
elements; the gradients are packed into a flat vector of the same layout.

Central (`ps_central`): rank 0 is the server and also a worker.
    every rank q > 0   Send g_q to rank 0                      (|W| up, point to point)
    rank 0             g = g_0 + g_1 + ... + g_{n-1}           (received in rank order)
                       W <- optimizer(W, g)                    (the only optimizer)
    rank 0 -> every q  Send W                                  (|W| down to each worker)
Rank 0's link carries (n-1)|W| in and (n-1)|W| out per step: with c = |W|/bandwidth
the step takes g_time + 2(n-1)c, the worst case of seed 4's (m+1)c + g .. 2mc + g for
m = n-1 remote workers (the server's own share never crosses the network).

Sharded (`ps_sharded`): W is cut into n segments S_0..S_{n-1} (sizes differ by at
most one element); rank r is the server of S_r.
    reduce-scatter  rank r sends g_q[S_s] ... every rank q sends segment s of its
                    gradient to rank s; rank r sums g[S_r] = sum_q g_q[S_r] in rank order
    update          rank r: W[S_r] <- optimizer(W[S_r], g[S_r])  (its own optimizer state)
    all-gather      rank r sends W[S_r] to every other rank
Every rank sends and receives (n-1)/n |W| in each phase: 2c(n-1)/n + g_time (seed 4's
"distributed" server). The optimizers the runner offers (SGD with momentum and weight
decay, Adam) are elementwise, so updating a segment equals updating whole tensors.

All messages are point-to-point (MPI_Send/Recv, Isend/Irecv) on a duplicate of the
world communicator, so the traffic has a real server's shape (an MPI_Reduce or
MPI_Bcast would use a tree). Sums are formed in a fixed rank order, so a run is
bit-identical to the next with the same seed and shares, and every rank holds the
very same W after every step. Floating buffers (BatchNorm statistics) are broadcast
from rank 0 before every step, as in `allreduce`.

Shares, batch slicing, evaluation, the initial broadcast of rank 0's model, buffer
sync and export are the data-parallel parts of `AllReduceStrategy`, inherited here;
only the gradient exchange, the optimizer placement and checkpoints differ.
"""
import logging
import time

import numpy as np
import torch

from training import cputime
from training.collectives import as_buffer, wait
from training.precision import Precision
from training.strategies.allreduce.strategy import AllReduceStrategy
from training.strategies.base import StrategyError

log = logging.getLogger(__name__)

_TAG_GRAD = 7411      # gradients (or gradient segments) towards their server
_TAG_PARAMS = 7412    # parameters (or segments) back from their server


def segments(n_elems, n):
    """Bounds of n segments of n_elems elements: segment s is [b[s], b[s+1]),
    b[s] = floor(s * n_elems / n), so sizes differ by at most one element."""
    return [n_elems * s // n for s in range(n + 1)]


class _ParameterServer(AllReduceStrategy):
    """The flat parameter vector, weighted gradient packing and the step skeleton.

    Subclasses implement `_make_optimizer(make_optimizer)` and `_exchange()`, which
    turns self.grad (this rank's g_r) into updated parameters in self.flat on every
    rank and returns the seconds it spent in communication.
    """

    def __init__(self, ctx, spec):
        super().__init__(ctx, spec)
        self.pcomm = None          # duplicate of the world communicator for the exchange
        self.params = []           # trainable parameters, in model order
        self.flat = None           # 1-D: W; every parameter's .data is a view into it
        self.grad = None           # 1-D: this rank's g_r = (n_r / B) grad L_r, same layout

    # -- setup ------------------------------------------------------------------------

    def setup(self, model, make_optimizer, example_input=None, resumed=None):
        """Rank 0's model everywhere, parameters flattened, shares fixed, optimizer placed.

        example_input: a batch of inputs for shares 'speed' (see AllReduceStrategy.setup).
        """
        self.model = model.to(self.device)
        self._broadcast_state()
        self.precision = Precision(self.spec.precision, self.device)
        self.pcomm = self.comm.Dup()
        self._flatten(model)
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.weights = self._share_weights(example_input, resumed)
        self._make_optimizer(make_optimizer)
        log.info("%s strategy: rank %d of %d, shares %s, %d parameters (%.2f MiB)",
                 self.name, self.rank, self.world_size, [round(w, 3) for w in self.weights],
                 self.flat.numel(), self.flat.numel() * self.flat.element_size() / 2**20)

    def _flatten(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise StrategyError(f"{self.name}: the model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise StrategyError(f"{self.name}: needs all trainable parameters with one dtype, "
                                f"got {sorted(map(str, dtypes))}; use the allreduce strategy for this model")
        total = sum(p.numel() for p in self.params)
        cuda = self.device.type == "cuda"
        # W and the gradients live in host memory, where the exchange and the servers'
        # optimizer work; on a GPU rank the model's parameters are views of a device copy
        # of W (`dev_flat`), refreshed after every exchange, and host_params alias W.
        self.flat = torch.empty(total, dtype=self.params[0].dtype, pin_memory=cuda)
        self.grad = torch.zeros_like(self.flat)
        self.dev_flat = torch.empty(total, dtype=self.flat.dtype, device=self.device) if cuda else None
        self.host_params = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[off:off + n].copy_(p.reshape(-1))
                if cuda:
                    self.dev_flat[off:off + n].copy_(p.reshape(-1))
                    p.data = self.dev_flat[off:off + n].view_as(p)
                    self.host_params.append(torch.nn.Parameter(self.flat[off:off + n].view_as(p)))
                else:
                    p.data = self.flat[off:off + n].view_as(p)
                    self.host_params.append(p)
                off += n

    def _refresh_device(self):
        """The model's parameters on a GPU rank take W's new values (a no-op on the CPU)."""
        if self.dev_flat is not None:
            self.dev_flat.copy_(self.flat, non_blocking=True)

    def _sync_host(self):
        """W takes the device copy's values (after loading a checkpoint on a GPU rank)."""
        if self.dev_flat is not None:
            self.flat.copy_(self.dev_flat)

    def _make_optimizer(self, make_optimizer):
        raise NotImplementedError

    def _exchange(self):
        raise NotImplementedError

    # -- per step ---------------------------------------------------------------------

    def _pack_gradients(self, weight):
        """self.grad <- weight * grad of every parameter (zeros where there is none)."""
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                view = self.grad[off:off + n]
                if p.grad is None:
                    view.zero_()
                elif p.grad.device.type == "cpu":
                    torch.mul(p.grad.reshape(-1), weight, out=view)
                else:
                    view.copy_(p.grad.reshape(-1) * weight)      # staged to host memory
                p.grad = None
                off += n

    def train_step(self, x, y):
        """One step on the global batch: forward/backward on n_r rows, the exchange."""
        t0 = time.perf_counter()
        n_local, global_batch, comm_s = self._start_step(x)
        self.model.train()
        for p in self.params:
            p.grad = None
        loss_sum, correct = self._forward_backward(x, y, n_local)
        self._pack_gradients(n_local / global_batch)
        comm_s += self._exchange()
        return self._finish_step(t0, comm_s, loss_sum, correct, global_batch)

    # -- checkpoints ------------------------------------------------------------------

    SAME_WORLD = True       # a checkpoint loads only into a world of its size (each rank keeps its own part)

    def _check_state(self, state):
        """A checkpoint of this strategy, of this rank, in a world of this size (or, where every
        rank keeps the whole model, SAME_WORLD False: of a larger one, the ranks past this
        world's left behind, as for allreduce)."""
        size = state.get("world_size")
        fits = size == self.world_size or not self.SAME_WORLD and isinstance(size, int) and size > self.world_size
        if state.get("strategy") != self.name or not fits or state.get("rank") != self.rank:
            raise ValueError(f"{self.name}: checkpoint of {state.get('strategy')} rank {state.get('rank')} "
                             f"of {state.get('world_size')} cannot load on rank {self.rank} of "
                             f"{self.world_size}; resume with the same strategy and world size")

    def close(self):
        """Free the exchange's duplicate communicator."""
        if self.pcomm is not None:
            self.pcomm.Free()
            self.pcomm = None
        super().close()


class CentralPSStrategy(_ParameterServer):
    """Rank 0 sums every rank's gradient, applies the optimizer and sends W to all.

    spec: conf Training (uses shares). See the module docstring for the step.
    """
    SAME_WORLD = False      # every rank's file has the whole model, and rank 0's the optimizer
    name = "ps_central"
    SERVER = 0

    def _make_optimizer(self, make_optimizer):
        self.optimizer = make_optimizer(self.host_params) if self.rank == self.SERVER else None
        self._recv = torch.empty_like(self.grad) if self.rank == self.SERVER else None

    def _exchange(self):
        """g = sum_r g_r at the server (rank order), W updated there, W sent to every rank."""
        comm_s = 0.0
        grad, flat = as_buffer(self.grad), as_buffer(self.flat)
        if self.rank == self.SERVER:
            recv = as_buffer(self._recv)
            for q in range(self.world_size):
                if q == self.SERVER:
                    continue
                tc = time.perf_counter()
                wait(self.pcomm.Irecv(recv, source=q, tag=_TAG_GRAD))
                comm_s += time.perf_counter() - tc
                np.add(grad, recv, out=grad)
            off = 0
            for p in self.host_params:
                p.grad = self.grad[off:off + p.numel()].view_as(p)
                off += p.numel()
            with cputime.counting("optimizer"):
                self.optimizer.step()
            tc = time.perf_counter()
            wait([self.pcomm.Isend(flat, dest=q, tag=_TAG_PARAMS)
                  for q in range(self.world_size) if q != self.SERVER])
            comm_s += time.perf_counter() - tc
        else:
            tc = time.perf_counter()
            wait(self.pcomm.Isend(grad, dest=self.SERVER, tag=_TAG_GRAD))
            wait(self.pcomm.Irecv(flat, source=self.SERVER, tag=_TAG_PARAMS))
            comm_s += time.perf_counter() - tc
        self._refresh_device()
        return comm_s

    def state_dict(self):
        """The whole model on every rank (all equal); the optimizer on the server."""
        return {"strategy": self.name, "rank": self.rank, "world_size": self.world_size,
                "model": self.model.state_dict(), "shares": self.weights, "shares_measured_on": self.measured_on(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state):
        """This rank's part of a checkpoint of the same rank (in a world as large, or larger)."""
        self._check_state(state)
        self.model.load_state_dict(state["model"])     # copies into the views of W (or of its device copy)
        self._sync_host()
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._keep_measured_shares(self._measured_shares(state))


class ShardedPSStrategy(_ParameterServer):
    """Rank r serves segment S_r of W: reduce-scatter, local update, all-gather.

    spec: conf Training (uses shares). See the module docstring for the step.
    """
    name = "ps_sharded"

    def _make_optimizer(self, make_optimizer):
        b = segments(self.flat.numel(), self.world_size)
        self.bounds = b
        self.lo, self.hi = b[self.rank], b[self.rank + 1]
        # A Parameter that aliases this rank's segment of W: the optimizer updates W in place.
        self.shard = torch.nn.Parameter(self.flat[self.lo:self.hi])
        self.shard_grad = torch.empty(self.hi - self.lo, dtype=self.flat.dtype)
        self._recv = {q: np.empty(self.hi - self.lo, dtype=as_buffer(self.flat).dtype)
                      for q in range(self.world_size) if q != self.rank}
        self.optimizer = make_optimizer([self.shard])

    def _exchange(self):
        """g[S_r] = sum_q g_q[S_r] (rank order), S_r updated here, all-gathered point to point."""
        n, r, b = self.world_size, self.rank, self.bounds
        grad, flat = as_buffer(self.grad), as_buffer(self.flat)
        others = [(r + k) % n for k in range(1, n)]     # staggered: rank r starts with r+1
        tc = time.perf_counter()
        reqs = [self.pcomm.Irecv(self._recv[q], source=q, tag=_TAG_GRAD) for q in others]
        reqs += [self.pcomm.Isend(grad[b[s]:b[s + 1]], dest=s, tag=_TAG_GRAD) for s in others]
        wait(reqs)
        comm_s = time.perf_counter() - tc
        acc = as_buffer(self.shard_grad)
        parts = [grad[b[r]:b[r + 1]] if q == r else self._recv[q] for q in range(n)]
        np.copyto(acc, parts[0])
        for part in parts[1:]:
            np.add(acc, part, out=acc)
        self.shard.grad = self.shard_grad
        with cputime.counting("optimizer"):
            self.optimizer.step()
        self.shard.grad = None
        tc = time.perf_counter()
        reqs = [self.pcomm.Irecv(flat[b[q]:b[q + 1]], source=q, tag=_TAG_PARAMS) for q in others]
        reqs += [self.pcomm.Isend(flat[b[r]:b[r + 1]], dest=s, tag=_TAG_PARAMS) for s in others]
        wait(reqs)
        self._refresh_device()
        return comm_s + time.perf_counter() - tc

    def state_dict(self):
        """The whole model (equal on every rank) and this rank's segment's optimizer state."""
        return {"strategy": self.name, "rank": self.rank, "world_size": self.world_size,
                "segment": [self.lo, self.hi], "model": self.model.state_dict(), "shares": self.weights,
                "shares_measured_on": self.measured_on(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        """This rank's part of a checkpoint of the same rank in an equal world."""
        self._check_state(state)
        if list(state["segment"]) != [self.lo, self.hi]:
            raise ValueError(f"{self.name}: checkpoint segment {state['segment']} differs from this "
                             f"rank's [{self.lo}, {self.hi}): the model changed since it was saved")
        self.model.load_state_dict(state["model"])     # copies into the views of W (or of its device copy)
        self._sync_host()
        self.optimizer.load_state_dict(state["optimizer"])
        self._keep_measured_shares(self._measured_shares(state))
