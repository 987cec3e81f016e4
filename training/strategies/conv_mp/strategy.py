"""Conv-layer model parallelism with a speed-proportional kernel split (Marques et al. 2018).

Every rank builds the same full model (same seed); the chosen Conv2d layers
(training.strategy's `layers`, default every distributable Conv2d) are replaced by
DistributedConv2d, rank r owning split[layer][r] of each layer's kernels. The split
comes from the strategy's `split` (manual weights, one per rank, applied to
every layer) or else from each rank's measured speed on the real layer shapes
(training.strategies.conv_mp.calibrate), measured when the model is set up (or at the first step, when
the model does not declare `input_shape`) and, every `recalibrate_every` steps,
corrected by the conv times the ranks measured in training.

Who holds what: rank 0, the master, runs the whole network and owns every parameter
that is not distributed, plus its own kernel shards; the other ranks own only their
shards. Every rank updates what it owns with its own optimizer; nothing is synchronised
because nothing is replicated. The shards are taken from the master's model at setup,
so they are exactly the single-process initialisation.

The batch: only the master reads it (batch_slice is (0, B) there and (0, 0) elsewhere,
where the runner may pass x=None); each distributed conv broadcasts its input, as in
the paper. The master computes the loss and broadcasts (loss, correct, samples) at the
end of the step, so StepStats agree on every rank.

Channel-wise layers right after a distributed conv (its activation, pooling) run inside
the shards, each rank on its own channels (training.strategies.conv_mp.fuse; `fuse`):
the master then runs a traced copy of the model's forward without them, which shares
the model's modules.

A distributed conv whose output (after its chain) is flattened into an nn.Linear alone
(the classifier) runs that Linear row-parallel (fuse's `heads`,
DistributedConv2d.attach_head): every rank multiplies its own channels by their columns of
the weight and the master sums the (N, classes) partials, so the master neither gathers
the feature map nor scatters its gradient, and the classifier's work is shared. The
Linear's place in the model holds a MovedToShards until export.

A distributed conv whose output (after its chain) goes to the next distributed conv
alone is linked to it (fuse's `links`, DistributedConv2d.link_to): its output is
all-gathered on every rank and is the next conv's input there, so neither the Gatherv
to the master nor the next Bcast is needed (in backward, each rank's channels of the
summed dX instead of a Reduce and a Scatterv).

Per step (see training.strategies.conv_mp.protocol.ShardProtocol for the commands):
    master:  forward (each distributed conv: Bcast X, own share and its chain, Gatherv Y;
             Y all-gathered over a link; with a head, the partial logits gathered), loss,
             backward (each: Scatterv dY, or Bcast dZ to a head; own share, Reduce dX),
             END(loss, correct, n)
    others:  serve() — run the commanded shares until END
    all:     optimizer.step() on own parameters; gather per-layer conv seconds at the master
"""
import copy
import logging
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from training import cputime
from training.collectives import wait
from training.strategies.base import StepStats, Strategy, StrategyError

from . import fuse
from .calibrate import (conv_shapes, corrected_speeds, kernel_block, measure_speeds, proportional_split,
                        worth_resharding)
from .layers import DistributedConv2d, why_not_distributable
from .protocol import ShardProtocol

log = logging.getLogger(__name__)


def _set_module(model, name, module):
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def select_layers(model, wanted, what="the model", ranks=1):
    """The names of the Conv2d layers of `model` to distribute over `ranks`, in model order:
    `wanted` (training.strategy.layers), else every one DistributedConv2d can split (the
    others logged), which has a kernel for each rank. StrategyError, one line naming the
    field, for a name that is not a Conv2d of the model or one that cannot be split, and
    where nothing is left to distribute. The client checks it at submit too
    (yarnapp.preflight.check_strategy)."""
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    why = {n: why_not_distributable(m) or (f"its {m.out_channels} kernel(s) cannot give each of {ranks} ranks one"
                                           if m.out_channels < ranks else None) for n, m in convs.items()}
    if wanted is None:
        names = [n for n in convs if why[n] is None]
        for n in sorted(set(convs) - set(names)):
            log.info("conv_model_parallel: not distributing %s: %s", n, why[n])
        if not names and convs:
            raise StrategyError(f"conv_model_parallel: none of {what}'s Conv2d layers can be split by output "
                                "channel (" + "; ".join(f"{n}: {why[n]}" for n in convs) + "); use the allreduce "
                                "strategy for it")
    else:
        unknown = [n for n in wanted if n not in convs]
        if unknown:
            raise StrategyError(f"training.strategy.layers: {unknown} are not Conv2d layers of "
                                f"{what}; its Conv2d layers are {sorted(convs)}")
        cannot = [f"{n}: {why[n]}" for n in dict.fromkeys(wanted) if why[n]]
        if cannot:
            raise StrategyError(f"training.strategy.layers: {'; '.join(cannot)}; leave "
                                f"{'it' if len(cannot) == 1 else 'them'} out (the layers that can be split: "
                                f"{[n for n in convs if why[n] is None]})")
        if not wanted:
            raise StrategyError("training.strategy.layers: [] names no layer; name the Conv2d layers to "
                                "distribute, or leave it out (every one that can be split)")
        names = [n for n in convs if n in set(wanted)]  # model order, duplicates dropped
    if not names:
        raise StrategyError(f"conv_model_parallel: {what} has no Conv2d layer to distribute; "
                            "use the allreduce strategy for it")
    return names


class MovedToShards(nn.Module):
    """Stands in the model for a Linear that runs row-parallel inside the shards of the
    distributed conv `conv` (DistributedConv2d.attach_head): it holds no parameters, and
    calling it is a bug (the master runs the fused graph, which does not call it)."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, *args):
        raise RuntimeError(f"conv_model_parallel: this Linear runs inside {self.conv}'s shards")

    def extra_repr(self):
        return f"in the shards of {self.conv}"


BUSY_QUOTA = 0.8    # a rank busy for this much of its CPU quota in a step is held back by it


class ConvModelParallelStrategy(Strategy):
    name = "conv_model_parallel"
    ROOT = 0

    def __init__(self, ctx, spec):
        super().__init__(ctx, spec)
        self.is_master = self.rank == self.ROOT
        self.model = None
        self.optimizer = None
        self.layers = {}            # name -> DistributedConv2d, in model order
        self.protocol = None
        # For TensorBoard (scalars()):
        self.split = None           # [rank] -> kernels owned over all distributed layers
        self.last_conv_s = None     # master: [rank] -> conv seconds (forward + backward) of the last step
        self.layer_split = None     # layer name -> kernels per rank (None until sharded)
        self.speeds = None          # layer name -> kernels/s per rank, when measured
        self.conv_s = 0.0           # this rank's conv seconds in the last step
        self._step_start = (0.0, 0.0)   # (wall, process CPU) at the start of this step
        self.steps = 0
        self._window = None         # master: [rank, layer] conv seconds since the last (re)calibration
        self._window_steps = 0
        self.fusion = None          # fuse.Fusion: channel-wise layers run inside the shards
        self._net = None            # the master's forward: the model, or its fused GraphModule
        self.heads = {}             # conv name -> name of the Linear it runs row-parallel

    # -- setup -----------------------------------------------------------------------------

    def setup(self, model, make_optimizer, example_input=None, resumed=None):
        """Shard the chosen convs: by the manual split, else by the split of the checkpoint
        resumed from (its speeds too: not calibrated again), else by speeds calibrated on the
        model's input_shape, else at the first step (its batch gives the shape).
        example_input is not used: calibration makes inputs of the layers' own shapes."""
        self.model = model
        self.make_optimizer = make_optimizer
        self.names = self._select_layers(model)
        # shares in whole vector blocks of the ranks' convolutions (calibrate.kernel_block)
        self.block = max(self.comm.allgather(kernel_block(self.device)))
        if self.is_master:
            model.to(self.device)
        mp = self.config
        if mp.split is not None:
            if len(mp.split) != self.world_size:
                raise ValueError(f"training.strategy.split: {len(mp.split)} weights for "
                                 f"{self.world_size} ranks; give one per rank")
            convs = dict(model.named_modules())
            self._shard({n: proportional_split(convs[n].out_channels, mp.split, self.block) for n in self.names})
        elif self._resumable_split(resumed):
            self.speeds = resumed.get("speeds")
            self._shard(resumed["split"])
        elif getattr(model, "input_shape", None) is not None:
            self._shard(self._calibrated_split(tuple(model.input_shape)))
        # else: sharded by the first train/eval step, once the batch shows the input shape

    def _resumable_split(self, resumed):
        """Whether every rank resumes a checkpoint of this world whose split covers the convs
        chosen now (collective: else each calibrates, or fails in load_state_dict, alike)."""
        mine = bool(resumed) and resumed.get("world_size") == self.world_size and \
            isinstance(resumed.get("split"), dict) and set(resumed["split"]) == set(self.names)
        return all(self.comm.allgather(mine))

    def _select_layers(self, model):
        return select_layers(model, self.config.layers, ranks=self.world_size)

    def _calibrated_split(self, sample_shape):
        shapes = conv_shapes(self.model, sample_shape, self.spec.batch_size, self.names)
        mine = measure_speeds(shapes, self.world_size, self.device, threads=self.ctx.me.threads)
        every = self.comm.allgather(mine)
        speeds = {s.name: [every[r][i] for r in range(self.world_size)] for i, s in enumerate(shapes)}
        split = {s.name: proportional_split(s.out_channels, speeds[s.name], self.block) for s in shapes}
        self.speeds, split = self.comm.bcast((speeds, split), root=self.ROOT)
        if self.is_master:
            for name in self.names:
                log.info("conv_model_parallel: %s speeds %s kernels/s -> split %s", name,
                         [round(s, 1) for s in self.speeds[name]], split[name])
        return split

    def _ensure_sharded(self, x):
        if self.layer_split is None:
            sample_shape = self.comm.bcast(tuple(x.shape[1:]) if self.is_master else None, root=self.ROOT)
            self._shard(self._calibrated_split(sample_shape))

    def _shard(self, split):
        """Collective: replace the chosen convs by DistributedConv2d with `split`, each
        with the channel-wise layers that follow it (fuse), unless `fuse: false`."""
        self.fusion = fuse.plan(self.model, self.names) if self.config.fuse else None
        followers = self.fusion.followers(self.model) if self.fusion else {}
        modules = dict(self.model.named_modules())
        for name in self.names:
            conv = modules[name]
            layer = DistributedConv2d(conv, self.comm, split[name], root=self.ROOT,
                                      followers=followers.get(name, ())).to(self.device)
            layer.load_from_master(conv)
            _set_module(self.model, name, layer)
            self.layers[name] = layer
        links, heads = self.comm.bcast((self.fusion.links, self.fusion.heads) if self.fusion else ({}, {}),
                                       root=self.ROOT)
        for a, b in links.items():
            self.layers[a].link_to(self.layers[b])
        self.heads = heads
        for a, b in heads.items():
            self.layers[a].attach_head(modules[b])
            _set_module(self.model, b, MovedToShards(a))
        self._net = self.fusion.graph_module(self.model) if self.fusion else self.model
        if self.fusion and self.is_master:
            log.info("conv_model_parallel: in the shards: %s", self.fusion.describe())
        self.protocol = ShardProtocol(list(self.layers.values()), self.comm, root=self.ROOT)
        self._set_split(split)
        self._window = np.zeros((self.world_size, len(self.names)))
        self._window_steps = 0
        self.optimizer = self.make_optimizer(self._params())
        log.info("conv_model_parallel rank %d: owns %s kernels on %s", self.rank,
                 {n: layer.count for n, layer in self.layers.items()}, self.device)

    def _set_split(self, split):
        self.layer_split = {n: list(split[n]) for n in self.names}
        self.split = [sum(self.layer_split[n][r] for n in self.names) for r in range(self.world_size)]

    def _params(self):
        """What this rank owns and updates: the master everything it holds, the others their shards."""
        if self.is_master:
            return list(self.model.parameters())
        return [p for layer in self.layers.values() for p in layer.parameters()]

    # -- steps -----------------------------------------------------------------------------

    def batch_slice(self, global_batch):
        return (0, global_batch) if self.is_master else (0, 0)

    def train_step(self, x, y):
        self._ensure_sharded(x)
        t0 = time.perf_counter()
        self._step_start = (t0, time.process_time())
        self._reset_timings()
        self.optimizer.zero_grad(set_to_none=True)
        if self.is_master:
            self.model.train()
            x, y = x.to(self.device), y.to(self.device)
            out = self._net(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            correct = (out.argmax(1) == y).sum().item()
            payload = self.protocol.finish([loss.item(), correct, len(y)])
        else:
            payload = self.protocol.serve()
        with cputime.counting("optimizer"):
            self.optimizer.step()
        self._gather_times()
        self.steps += 1
        every = self.config.recalibrate_every
        if every and self.config.split is None and self._window_steps >= every:
            self.recalibrate()
        comm_s = self._comm_s()
        return StepStats(loss=float(payload[0]), correct=int(payload[1]), samples=int(payload[2]),
                         compute_s=time.perf_counter() - t0 - comm_s, comm_s=comm_s)

    def eval_step(self, x, y):
        self._ensure_sharded(x)
        if not self.is_master:
            self.protocol.serve()
            return 0.0, 0, 0
        self.model.eval()
        try:
            with torch.no_grad():
                x, y = x.to(self.device), y.to(self.device)
                out = self._net(x)
                loss_sum = F.cross_entropy(out, y, reduction="sum").item()
                correct = (out.argmax(1) == y).sum().item()
        finally:
            self.model.train()
        self.protocol.finish([loss_sum, correct, len(y)])
        return loss_sum, correct, len(y)

    def _reset_timings(self):
        self.protocol.timings.reset()
        for layer in self.layers.values():
            layer.timings.reset()

    def _comm_s(self):
        return self.protocol.timings.comm_s + sum(layer.timings.comm_s for layer in self.layers.values())

    def _gather_times(self):
        """Every rank's per-layer conv seconds of this step, at the master (for TensorBoard
        and recalibration). A throttled rank waits politely (training.collectives.set_polite)."""
        with cputime.counting("protocol"):
            self._gather_times_now()

    def _share_seconds(self):
        """[wall, effective] conv seconds of each layer on this rank in this step. Effective,
        what recalibration balances: the wall time, except on a CPU rank whose CPU quota
        held it back in this step (under a quota, 0.5 vcore, and busy for at least
        BUSY_QUOTA of it): there its CPU seconds over its vcores count, at least the wall
        time. Its wall time in a share leaves out the stops of its quota, the one between
        a command's arrival and the share's start among them, in which the others wait
        for it: counted by wall time, such a rank looked faster than it is, and
        recalibration gave it kernels the master then waited for (1 + 0.5 vcore,
        `benchmarks/conv_mp.py --quick`: 0.169 s/step against 0.146 s for the split
        calibrated at start). A rank under a quota it does not use up is timed by the wall.
        (CPU seconds are the whole process's: every thread of its convolutions.)

        The quota is spent on the whole step, not on the shares alone: the rank's protocol,
        its optimizer and its polite waits take ~20% of it (a 0.5-vcore worker at `--quick`:
        14 of 73 ms a step). So each share is charged its part of all the step's CPU (its
        CPU times the step's CPU over the shares'): the time the rank has left for
        convolutions is what its kernels follow. Charged the shares' CPU alone, it was given
        kernels it had no quota for, and the master waited 10–18 ms a step for it (1 + 0.5
        vcore, `benchmarks/conv_mp.py --quick`'s hetero prop, 6 interleaved runs each: conv2
        split [256, 128] in 4 of 6 and 0.169 s a step (0.160–0.180), against [272, 112] in
        all and 0.163 s (0.162–0.166) charged whole). What is charged per kernel grows as a
        rank's kernels shrink (its fixed CPU, a throttled master's rest of the network,
        spread over fewer), yet recalibration settles: where it stops, every quota-bound
        rank's whole CPU a step over its vcores is the same (a unit test plays it out)."""
        wall = np.array([layer.timings.conv_s for layer in self.layers.values()])
        me = self.ctx.me
        step_wall = time.perf_counter() - self._step_start[0]
        step_cpu = time.process_time() - self._step_start[1]
        if not me.throttled or torch.device(self.device).type != "cpu" or \
                step_cpu < BUSY_QUOTA * me.vcores * step_wall:
            return np.array([wall, wall])
        cpu = np.array([layer.timings.conv_cpu_s for layer in self.layers.values()])
        shares = float(cpu.sum())
        whole = cpu * max(1.0, step_cpu / shares) if shares > 1e-6 else cpu     # no kernels: nothing to charge
        return np.array([wall, np.maximum(wall, whole / me.vcores)])

    def _gather_times_now(self):
        from mpi4py import MPI
        mine = self._share_seconds()
        self.conv_s = float(mine[0].sum())
        every = np.empty((self.world_size, *mine.shape)) if self.is_master else None
        t0 = time.perf_counter()
        req = self.comm.Igather([mine, MPI.DOUBLE], [every, MPI.DOUBLE] if self.is_master else None,
                                root=self.ROOT)
        wait(req)
        self.protocol.timings.comm_s += time.perf_counter() - t0
        if self.is_master:
            self.last_conv_s = every[:, 0].sum(axis=1).tolist()
            self._window += every[:, 1]
        self._window_steps += 1

    def scalars(self):
        """Each rank's kernels (over all distributed layers) and conv seconds of the last step."""
        out = {}
        for key, values in (("split", self.split), ("last_conv_s", self.last_conv_s)):
            out.update({f"model_parallel/{key}/rank{r}": v for r, v in enumerate(values or ())})
        return out

    def own_cpu_s(self, step_cpu_s, counted):
        """A worker's: all but its shares, the optimizer and its waits (Strategy's); the
        master's: its protocol alone (the distributed layers' forward, the backward of their
        communication, its commands, less the shares and waits inside them), since the
        rest of its step is the model the planner times as a whole."""
        if self.is_master:
            return counted["protocol"]
        return super().own_cpu_s(step_cpu_s, counted)

    # -- recalibration ---------------------------------------------------------------------

    def recalibrate(self):
        """Collective: correct each rank's speeds by the conv times measured in training
        since the last calibration (calibrate.corrected_speeds), re-split in
        proportion, and reshard the layers where that pays (calibrate.worth_resharding)."""
        split = None
        if self.is_master:
            seconds = {n: (self._window[:, i] / self._window_steps).tolist() for i, n in enumerate(self.names)}
            speeds = self.speeds or {n: [float(c) for c in self.layer_split[n]] for n in self.names}
            self.speeds = corrected_speeds(speeds, self.layer_split, seconds, self.block)
            split = {}
            for n in self.names:
                new = proportional_split(self.layers[n].out_channels, self.speeds[n], self.block)
                worth = worth_resharding(self.layer_split[n], new, self.speeds[n], block=self.block)
                split[n] = new if worth else self.layer_split[n]
        self.speeds, split = self.comm.bcast((self.speeds, split), root=self.ROOT)
        self._window = np.zeros((self.world_size, len(self.names)))
        self._window_steps = 0
        if split != self.layer_split:
            log.info("conv_model_parallel: recalibrated split %s -> %s", self.layer_split, split)
            self._reshard(split)

    def _reshard(self, split):
        """Collective: move the shards and their optimizer state to `split`."""
        state = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(self._params())}
        for name in self.names:
            layer = self.layers[name]
            old_split = layer.split
            if split[name] == old_split:
                continue
            old, _ = layer.reshard(split[name])
            for p in old:
                entry = state["state"].get(index[id(p)], {})
                for key in sorted(entry):
                    value = entry[key]
                    if torch.is_tensor(value) and value.shape == p.shape:
                        entry[key] = layer.redistribute(value, old_split).to(value.device)
        self._set_split(split)
        self.optimizer = self.make_optimizer(self._params())
        self.optimizer.load_state_dict(state)

    # -- checkpoints and export ------------------------------------------------------------

    def state_dict(self):
        if self.is_master:
            model = self.model.state_dict()
        else:
            model = {f"{n}.{k}": v for n, layer in self.layers.items() for k, v in layer.state_dict().items()}
        return {"strategy": self.name, "rank": self.rank, "world_size": self.world_size,
                "split": self.layer_split, "speeds": self.speeds, "steps": self.steps, "model": model,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state):
        """Collective: every rank loads its own part (saved by the same rank of an equal world)."""
        if state.get("world_size") != self.world_size or state.get("rank") != self.rank:
            raise ValueError(f"conv_model_parallel: checkpoint of rank {state.get('rank')} of "
                             f"{state.get('world_size')} cannot load on rank {self.rank} of {self.world_size}")
        split = state["split"]
        if split is not None and self.layer_split is None:
            self._shard(split)
        elif split is not None and split != self.layer_split:
            self._reshard(split)  # values are overwritten below; this sets the shapes
        kept = [b for b in self.heads.values() if f"{b}.weight" in state["model"]] if self.is_master else None
        kept = self.comm.bcast(kept, root=self.ROOT)
        if kept:
            raise ValueError(f"conv_model_parallel: this checkpoint holds the classifier {kept[0]!r} whole on "
                             "rank 0 (written with training.strategy.fuse: false, or by a yarnapp that did not "
                             "run it in the shards); resume it with training.strategy.fuse: false")
        if self.is_master:
            self.model.load_state_dict(state["model"])
        else:
            for n, layer in self.layers.items():
                prefix = f"{n}."
                layer.load_state_dict({k[len(prefix):]: v for k, v in state["model"].items()
                                       if k.startswith(prefix)})
        if state["optimizer"] is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        self.speeds = state.get("speeds")

    def model_for_export(self):
        """Collective: the full model with ordinary Conv2d layers, on the CPU, at the master."""
        convs = {n: layer.to_conv2d() for n, layer in self.layers.items()}
        linears = {b: self.layers[a].to_linear() for a, b in self.heads.items()}
        if not self.is_master:
            return None
        moved = {b: self.model.get_submodule(b) for b in linears}
        for n, module in {**convs, **linears}.items():
            _set_module(self.model, n, module)
        try:
            export = copy.deepcopy(self.model).cpu()
        finally:
            for n, module in {**self.layers, **moved}.items():
                _set_module(self.model, n, module)
        return export
