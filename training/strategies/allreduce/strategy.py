"""Data parallelism with ring all-reduce: every rank holds the whole model.

Rank r reads n_r rows of each global batch of B = sum_r n_r rows (`shares`: equal,
proportional to vcores or to measured speed, or given weights; largest-remainder
rounding, `split_rows`). It backpropagates its local mean loss L_r and contributes
w_r = n_r / B times its gradient, so the summed gradient

    g = sum_r (n_r / B) grad L_r = grad (1/B) sum_{i in batch} loss_i

is the gradient of the mean loss over the global batch: every step equals the step
one process would take on the whole batch, whatever the split. The gradients are
reduced in buckets while backward runs (training.collectives.GradientReducer), in
a fixed summation order, so a run is bit-identical to the next with the same seed
and the same shares (measured 'speed' shares may differ from run to run; a checkpoint
keeps the ones measured, so a run resumed from it splits its batches as before).

Parameters and buffers are broadcast from rank 0 at setup; floating buffers (e.g.
BatchNorm running statistics, computed from local rows) are broadcast from rank 0
again before every step, as torch DDP does, so all replicas stay identical, and before
an evaluation, so that the test set is scored with the model that is saved (rank 0's).
"""
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

from training import collectives, cputime, devices
from training.precision import Precision
from training.strategies.base import StepStats, Strategy
from training.strategies.shares import SPEED_PROBE_ROWS, costly_ranks, measured_weights, split_rows

log = logging.getLogger(__name__)
RING_TIMINGS = 5      # all-reduces of the gradient timed for the costly-rank line (their median)


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


class AllReduceStrategy(Strategy):
    """Replicated model, batch split by `spec.shares`, gradients summed by all-reduce.

    spec: conf Training (uses shares; its strategy block: bucket_mb, ring_threshold_kb).
    `overlap` picks how bucket reductions progress during backward (see
    collectives.GradientReducer): None chooses 'thread' when the rank's vcores leave
    at least one core beyond its torch compute threads, else 'poll' (a communication
    thread on a busy core only slows compute: benchmarks/README.md). Set it on the
    instance before `setup` to compare.
    """
    name = "allreduce"
    overlap = None

    def __init__(self, ctx, spec):
        super().__init__(ctx, spec)
        self.model = None
        self.optimizer = None
        self.reducer = None
        self.weights = None          # one share weight per rank
        self._float_buffers = []

    # -- setup ------------------------------------------------------------------------

    def setup(self, model, make_optimizer, example_input=None, resumed=None):
        """Make every rank's model rank 0's, build the optimizer, fix the shares.

        example_input: a batch of inputs for shares 'speed' (default: random rows of
        `model.input_shape` when the model declares one; without either the shares
        follow the ranks' vcores).
        """
        self.model = model.to(self.device)
        self._broadcast_state()
        self.optimizer = make_optimizer(model.parameters())
        # a CPU rank beside fp16 GPU ranks scales its loss as they do (training.precision)
        self.precision = Precision(self.spec.precision, self.device, scaled=any(r.gpus for r in self.ctx.ranks))
        ar = self.config
        overlap = self.overlap
        if overlap is None:
            spare = self.ctx.me.vcores - torch.get_num_threads()
            overlap = "thread" if spare >= 1 else "poll"
        self.reducer = collectives.GradientReducer(
            model.parameters(), self.comm, bucket_mb=ar.bucket_mb,
            ring_threshold_kb=ar.ring_threshold_kb, overlap=overlap, shared_memory=ar.shared_memory)
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.weights = self._share_weights(example_input, resumed)
        log.info("allreduce strategy: rank %d of %d, shares %s, %d buckets, overlap=%s",
                 self.rank, self.world_size, [round(w, 3) for w in self.weights],
                 len(self.reducer.buckets), self.reducer.overlap)

    def _broadcast_state(self):
        """Parameters and buffers of rank 0 to every rank (in place, tensor by tensor)."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                devices.bcast_(self.comm, t, root=0)

    def _share_weights(self, example_input, resumed=None):
        given = self.given_shares()
        if given is not None:
            return given
        if self.world_size == 1:
            return [1.0]
        if resumed is not None:         # every rank alike (Checkpointer.latest): rank 0's state has them
            saved = self.comm.bcast(self._measured_shares(resumed) if self.rank == 0 else None, root=0)
            if saved:
                log.info("shares 'speed': the checkpoint's measured shares %s (not measured again), so that "
                         "the steps split their batches as before", [round(w, 3) for w in saved])
                return saved
        if example_input is None and getattr(self.model, "input_shape", None) is not None:
            gen = torch.Generator().manual_seed(self.rank)
            example_input = torch.randn((SPEED_PROBE_ROWS, *self.model.input_shape), generator=gen)
        if example_input is None:
            log.warning("shares 'speed': no example input and the model declares no "
                        "input_shape; splitting by vcores instead")
            return [float(r.vcores) for r in self.ctx.ranks]
        weights, fits = measured_weights(self.comm, self.model, example_input.to(self.device),
                                         self.spec.batch_size)
        log.info("shares 'speed': passes %s; weights (rows/s on each rank's share) %s",
                 ", ".join(f"{1e3 * a:.2f} ms + n / {s:.0f} rows/s" for a, s in fits), [round(w, 1) for w in weights])
        self._warn_costly(fits, weights)
        return weights

    def _warn_costly(self, fits, weights):
        """Rank 0 says, one line per rank, when a rank slows the step down: its share is
        worth less than the all-reduce it adds (timed here on the gradient's size: the median
        of RING_TIMINGS; one timing's spike named both ranks of a two-rank job). Where every
        rank would be named, one line says the split as a whole is slower than one rank."""
        n_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        buf = np.zeros(n_params, dtype=np.float32)
        collectives.allreduce_(buf, self.comm)                         # warm
        took = []
        for _ in range(RING_TIMINGS):
            t = time.perf_counter()
            collectives.allreduce_(buf, self.comm)
            took.append(time.perf_counter() - t)
        ring_s = self.comm.allreduce(float(np.median(took)), op=_mpi_max())
        if self.rank != 0:
            return
        costly = costly_ranks(fits, self.spec.batch_size, ring_s, weights)
        if costly and len(costly) == self.world_size:
            log.warning("data parallelism over these %d ranks is predicted slower than one rank alone: a step "
                        "%.1f ms split, where its all-reduce takes %.1f ms of it; use fewer, faster containers, "
                        "or larger batches", self.world_size, 1e3 * costly[0][2], 1e3 * ring_s)
            return
        for r, share, with_s, without_s in costly:
            info = self.ctx.ranks[r]
            where = f"{info.gpus} GPU" if info.gpus else f"cpu, {info.vcores:g} vcores"
            log.warning("rank %d (%s, %s) gets %.0f%% of each batch but costs more than it saves: a step is "
                        "predicted %.1f ms with it and %.1f ms without (all-reduce %.1f ms); drop its group "
                        "or give it more vcores", r, info.container, where, 100 * share, 1e3 * with_s,
                        1e3 * without_s, 1e3 * ring_s)

    # -- per step ---------------------------------------------------------------------

    def batch_slice(self, global_batch):
        rows = split_rows(global_batch, self.weights)
        lo = sum(rows[:self.rank])
        return lo, lo + rows[self.rank]

    def _sync_buffers(self):
        if self.device.type == "cpu":
            collectives.wait([self.comm.Ibcast(collectives.as_buffer(b), root=0)
                              for b in self._float_buffers])
            return
        hosts = [b.detach().cpu() for b in self._float_buffers]     # staged through host memory
        collectives.wait([self.comm.Ibcast(collectives.as_buffer(h), root=0) for h in hosts])
        with torch.no_grad():
            for b, h in zip(self._float_buffers, hosts):
                b.copy_(h, non_blocking=True)

    def _start_step(self, x):
        """(rows here, rows in the global batch, seconds of communication): the batch
        size is agreed on (a rank may have none) and float buffers synchronised."""
        from mpi4py import MPI
        n_local = 0 if x is None else int(len(x))
        tc = time.perf_counter()
        total = np.array([n_local], dtype=np.int64)
        collectives.wait(self.comm.Iallreduce(MPI.IN_PLACE, total, op=MPI.SUM))
        if self.world_size > 1 and self._float_buffers:
            self._sync_buffers()
        if int(total[0]) == 0:
            raise ValueError("train_step: the global batch is empty on every rank")
        return n_local, int(total[0]), time.perf_counter() - tc

    def _forward_backward(self, x, y, n_local):
        """Backward of this rank's mean loss; returns (summed loss, correct) of its rows."""
        if not n_local:
            return 0.0, 0
        x, y = devices.to_device(x, self.device), devices.to_device(y, self.device)
        with cputime.counting("model"):
            with self.precision.autocast():
                out = self.model(x)
                loss = F.cross_entropy(out.float(), y)
            self.precision.backward(loss)
            return float(loss.detach()) * n_local, int((out.detach().argmax(1) == y).sum())

    def _finish_step(self, t0, comm_s, loss_sum, correct, global_batch):
        """Sum loss and correct counts over the world; the step's StepStats."""
        from mpi4py import MPI
        tc = time.perf_counter()
        scalars = np.array([loss_sum, correct], dtype=np.float64)
        collectives.wait(self.comm.Iallreduce(MPI.IN_PLACE, scalars, op=MPI.SUM))
        comm_s += time.perf_counter() - tc
        return StepStats(loss=float(scalars[0] / global_batch), correct=int(round(scalars[1])),
                         samples=global_batch, compute_s=time.perf_counter() - t0 - comm_s,
                         comm_s=comm_s)

    def train_step(self, x, y):
        """One SGD step on the global batch: forward/backward on n_r rows, weighted sum."""
        t0 = time.perf_counter()
        n_local, global_batch, comm_s = self._start_step(x)
        self.model.train()
        self.reducer.begin(n_local / global_batch)
        loss_sum, correct = self._forward_backward(x, y, n_local)
        comm_s += self.reducer.finish()
        with cputime.counting("optimizer"):
            self.precision.step(self.optimizer)
        return self._finish_step(t0, comm_s, loss_sum, correct, global_batch)

    def before_eval(self):
        """Rank 0's floating buffers on every rank: each rank's BatchNorm statistics moved
        on its own rows in the last step, and the test rows a rank scored were scored with
        its own; the figures reported were not the saved model's (rank 0's), by 0.8
        points of accuracy on digits stopped at step 50."""
        if self.world_size > 1 and self._float_buffers:
            self._sync_buffers()

    def eval_step(self, x, y):
        """(summed loss, correct, rows) over this rank's rows; no communication."""
        if x is None or len(x) == 0:
            return 0.0, 0, 0
        was_training = self.model.training
        self.model.eval()
        x, y = devices.to_device(x, self.device), devices.to_device(y, self.device)
        try:
            with torch.no_grad(), self.precision.autocast():
                out = self.model(x).float()
                loss_sum = float(F.cross_entropy(out, y, reduction="sum"))
                correct = int((out.argmax(1) == y).sum())
        finally:
            self.model.train(was_training)
        return loss_sum, correct, int(len(x))

    # -- checkpoints and export -------------------------------------------------------

    def state_dict(self):
        """The whole model and optimizer from rank 0 only: they are identical on every rank,
        so the others write none (a checkpoint of N ranks is one model's bytes, not N).
        Every rank keeps its own precision state (fp16's loss scale lives on GPU ranks)."""
        own = self.precision.state_dict()
        if self.rank != 0:
            return own
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "shares": self.weights, "shares_measured_on": self.measured_on(), **own}

    def load_state_dict(self, state):
        """Collective: rank 0 loads the checkpoint's model and optimizer, and sends them to
        every rank tensor by tensor, into place (the optimizer's layout first, its state's
        tensors left out); a checkpoint that does not fit fails on every rank alike. This
        rank's own precision state. (The whole state pickled through one bcast took the
        checkpoint's size twice more on rank 0 and three times on the others: a rank that
        trained in 715 MiB of its 1 GiB container was killed for memory at every resume.)"""
        error = layout = None
        if self.rank == 0:
            try:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                opt = self.optimizer.state_dict()
                layout = ({**opt, "state": _without_tensors(opt["state"])}, self._measured_shares(state))
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they wait in bcast
                error = (type(e).__name__, str(e))
        error, layout = self.comm.bcast((error, layout), root=0) if self.world_size > 1 else (error, layout)
        if error:
            raise {"KeyError": KeyError, "ValueError": ValueError, "TypeError": TypeError}.get(error[0],
                                                                                              RuntimeError)(error[1])
        if self.rank != 0:
            self.optimizer.load_state_dict(_with_empty_tensors(layout[0]))
        self._broadcast_state()
        with torch.no_grad():
            for group in self.optimizer.param_groups:       # the same order on every rank
                for p in group["params"]:
                    for key in sorted(self.optimizer.state.get(p, {})):
                        if torch.is_tensor(self.optimizer.state[p][key]) and self.world_size > 1:
                            devices.bcast_(self.comm, self.optimizer.state[p][key], root=0)
        self.precision.load_state_dict(state)
        self._keep_measured_shares(layout[1])

    def measured_on(self):
        """What shares: speed measured its shares on, kept with them: each rank's vcores and
        GPUs; None where they were not measured (vcores, equal, or given)."""
        if self.given_shares() is not None:
            return None
        return [[float(r.vcores), int(r.gpus)] for r in self.ctx.ranks]

    def _measured_shares(self, state):
        """The shares a checkpoint's run measured, where this world would measure them on the
        same ranks (as many, of the same vcores and GPUs), else None. A checkpoint of shares
        given (vcores: 1, 0.5, 0.5) resumed with shares: speed on three 1-vcore ranks kept
        those as "the checkpoint's measured shares", not measured again (an audit)."""
        saved = state.get("shares")
        if not saved or len(saved) != self.world_size:
            return None
        if "shares_measured_on" in state and state["shares_measured_on"] != self.measured_on():
            return None         # (a checkpoint written before 2026-11-30 says nothing of it: kept)
        return [float(w) for w in saved]

    def _keep_measured_shares(self, saved):
        """shares: speed, resumed: split the batches by the weights the checkpoint's run
        measured (`saved`: _measured_shares), not by today's. Another split sums each gradient
        in another order, equal to rounding but not to the bit, so the resumed steps would not
        be the steps the uninterrupted run took. Measured afresh where the world changed."""
        if self.spec.shares != "speed" or not saved:
            return
        if saved != self.weights and self.rank == 0:
            log.info("shares: speed: resumed with the checkpoint's measured shares %s (measured now: %s), "
                     "so that the steps split their batches as before", [round(w, 3) for w in saved],
                     [round(w, 3) for w in self.weights])
        self.weights = saved

    def model_for_export(self):
        return self.model if self.rank == 0 else None

    def close(self):
        """Release the reducer's hooks, thread and communicator."""
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None


class _Tensor:
    """A tensor's place in an optimizer's state sent without it (shape and dtype)."""

    def __init__(self, t):
        self.shape, self.dtype = tuple(t.shape), t.dtype


def _without_tensors(obj):
    if torch.is_tensor(obj):
        return _Tensor(obj)
    if isinstance(obj, dict):
        return {k: _without_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_without_tensors(v) for v in obj)
    return obj


def _with_empty_tensors(obj):
    if isinstance(obj, _Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: _with_empty_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_with_empty_tensors(v) for v in obj)
    return obj
