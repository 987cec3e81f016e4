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
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

from training import cputime
from training.collectives import mpi_datatype, wait
from training.partition import PartitionError, build_hypergraph, evaluate, hypergraph_partition, layer_chain
from training.strategies.base import StepStats, Strategy, StrategyError

from .execution import ROOT, PartitionedModel

log = logging.getLogger(__name__)


def check_chain(chain):
    """`chain`, unless the strategy cannot run it (PartitionError): dropout with p > 0
    would draw different masks on different ranks. The client checks it at submit too
    (yarnapp.preflight.check_strategy)."""
    drop = [op.name for layer in chain.layers for op in layer.pre + layer.post if op.dropout]
    if drop:
        raise PartitionError(f"hypergraph strategy: dropout ({drop}) would draw different masks on "
                             "different ranks; remove it or set p=0")
    return chain


class HypergraphStrategy(Strategy):
    """The strategy of the runner (see the module docstring); registry name "hypergraph"."""
    name = "hypergraph"

    def __init__(self, ctx, spec):
        super().__init__(ctx, spec)
        self.model = None          # rank 0: the full model (for export); elsewhere dropped once partitioned
        self.net = None            # PartitionedModel
        self.optimizer = None
        self.make_optimizer = None
        self.input_shape = None
        self.capacities = None
        self.predicted = None      # training.partition.evaluate of the partition
        self.split = None          # [rank] -> units held (scalars(): TensorBoard)
        self.layer_split = None    # layer name -> units per rank
        self.steps = 0

    # -- setup -------------------------------------------------------------------------

    def setup(self, model, make_optimizer, example_input=None, resumed=None):
        """Keep the model (rank 0's weights on every rank); the partition is made by the first
        train/eval step (the batch gives the input shape) or taken from a checkpoint.
        example_input is not used: 'speed' capacities are measured on the model's own shape."""
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
        caps = self.config.capacities
        if caps is not None:
            if len(caps) != self.world_size:
                raise StrategyError(f"hypergraph strategy: {len(caps)} capacities for {self.world_size} ranks "
                                    "(training.strategy.capacities); give one per rank")
            return [float(c) for c in caps]
        from training.strategies.shares import SPEED_PROBE_ROWS, measure_speed
        given = self.given_shares()
        if given is not None:
            return given
        gen = torch.Generator().manual_seed(self.rank)
        example = torch.randn((SPEED_PROBE_ROWS, *self.input_shape), generator=gen).to(self.device)
        speeds = self.comm.allgather(measure_speed(self.model.to(self.device), example))
        log.info("hypergraph: measured speeds (rows/s) %s", [round(s, 1) for s in speeds])
        return speeds

    def _partition(self, input_shape, parts=None):
        """Collective: trace the chain, partition it (rank 0; broadcast) unless `parts` is
        given, and keep this rank's units."""
        self.input_shape = tuple(int(s) for s in input_shape)
        chain = check_chain(layer_chain(self.model, self.input_shape))
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
        """(loss, correct, rows) of the step from the loss rank, on every rank (a polite
        wait where throttled: the others wait here for the loss rank's backward)."""
        from mpi4py import MPI
        t0 = time.perf_counter()
        out = np.array(values if self.rank == self.net.loss_rank else [0.0, 0, 0], dtype=np.float64)
        wait(self.comm.Ibcast([out, MPI.DOUBLE], root=self.net.loss_rank))
        self.net.counters.comm_s += time.perf_counter() - t0
        return float(out[0]), int(out[1]), int(out[2])

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
        with cputime.counting("optimizer"):
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

    def scalars(self):
        """Each rank's units (conv channels and neurons over every layer)."""
        return {f"model_parallel/split/rank{r}": v for r, v in enumerate(self.split or ())}

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
