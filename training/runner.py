"""The built-in training runner (`run.function: training.runner:main`).

It owns the loop: data, model, strategy, epochs/steps, evaluation, metrics,
checkpoints and TensorBoard. Strategies (training.strategies) own how the model and
its gradients are spread over the world. On start it resumes from the newest
complete checkpoint, so a restarted world continues exactly where it left off.
"""
import collections
import logging
import math
import random
import time

import numpy as np
import torch

from conf.errors import YarnappError
from launcher import memory   # plain functions reading this process's memory cgroup

from . import collectives, lazy_dynamo, strategies, trained
from .checkpoint import CheckpointError, Checkpointer, other_data, other_model, rng_state, set_rng_state, what_it_trains
from .data import open_dataset
from .data.common import DataChanged
from .models import build_model, check_output
from .tensorboard import TBLogger

log = logging.getLogger(__name__)


def _not_retried(line):
    """A CheckpointError every attempt would meet again (the same states): launcher.retries
    does not retry it (`certain`)."""
    error = CheckpointError(line)
    error.certain = True
    return error


class Diverged(YarnappError, ValueError):
    """Training diverged: the loss was not a number (nan, inf) for DIVERGED_STEPS steps in a
    row, or the weights were not when a checkpoint was due (a nan stays nan: every step after
    trains nothing; a job that went on "succeeded" with a model of chance accuracy, and its
    checkpoints held nan). No checkpoint of such weights is written, so the last one is of
    finite weights; a restart resumes from it bit-identically and would diverge again: not
    retried."""
    certain = ("a restart would resume from the last checkpoint bit-identically and diverge again, "
               "so it was not retried")


DIVERGED_STEPS = 3      # (a step whose loss is inf may leave the weights finite: its update skipped)


def _finite(state):
    """Whether every floating-point tensor in a (nested) state is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def _first_words(e, limit=160):
    """An exception as a short one-line excerpt (torch's state_dict errors run to pages)."""
    text = " ".join(f"{type(e).__name__}: {e}".replace(";", ",").split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def make_optimizer_factory(spec):
    def make(params):
        if spec.optimizer == "adam":
            return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    return make


class Runner:
    def __init__(self, ctx):
        self.ctx = ctx
        self.spec = spec = ctx.job.training
        self.comm = ctx.comm
        lazy_dynamo.defer()             # no torch._dynamo import for the optimizer: 1.4 CPU-s a start
        torch.set_num_threads(ctx.me.threads)
        collectives.set_polite(ctx.me.throttled)
        collectives.doorbells(self.comm)    # one host: polite waits sleep until another rank waits
        self.train = open_dataset(spec.data, "train", ctx)
        self.test = open_dataset(spec.data, "test", ctx, reference=self.train)
        torch.manual_seed(spec.seed)
        random.seed(spec.seed)          # a model of the user's drawing from these: the same run again
        np.random.seed(spec.seed % 2**32)
        model = build_model(spec.model, self.train.shape, self.train.num_classes, spec.model_options)
        example = self.train.example(16)                                # e.g. for shares: speed
        check_output(model, spec.model, example, self.train.num_classes)
        self.strategy = strategies.get(spec.strategy.name)(ctx, spec)
        c = ctx.job.checkpoint
        self.trains = what_it_trains(spec)      # what this job's checkpoints are of
        self.ckpt = Checkpointer(ctx.checkpoint_uri, self.comm, c.keep, ctx.generation, app_id=ctx.app_id,
                                 name=ctx.job.name, resume=c.resume, siblings=ctx.checkpoint_siblings,
                                 data=self._data(), trains=self.trains)
        self.start_step, state = self.ckpt.latest()     # first: a resumed run's split is the checkpoint's
        if state is not None:
            self._check_same_job(state, ctx)
        self.strategy.setup(model, make_optimizer_factory(spec), example_input=example,
                            resumed=state.get("strategy") if state is not None else None)
        if state is not None:
            try:
                self.strategy.load_state_dict(state["strategy"])
            except (RuntimeError, KeyError, ValueError, TypeError) as e:   # torch's: "Error(s) in loading..."
                if "out of memory" in str(e) or type(e).__module__.startswith("mpi4py"):
                    raise                                   # not the checkpoint's fault: retried as any crash
                log.error("loading the checkpoint of step %d", self.start_step, exc_info=True)
                raise _not_retried(
                    f"checkpoint.resume: the checkpoint of step {self.start_step} (application "
                    f"{self.ckpt.resumed_app or ctx.app_id}) does not fit this job's model {spec.model!r} or "
                    f"strategy {spec.strategy.name!r} ({_first_words(e)}); resume with the job that wrote it, "
                    f"or start afresh (checkpoint.resume: never)") from None
            set_rng_state(state["rng"])
            self._job_hyperparameters()
            log.info("resumed from the checkpoint of step %d", self.start_step)
        self.lo, self.hi = self.strategy.batch_slice(spec.batch_size)
        self.loader = self.train.batches(spec.batch_size, self.lo, self.hi, seed=spec.seed,
                                         start_step=self.start_step, epochs=spec.epochs)
        self.steps_per_epoch = self.loader.steps_per_epoch
        self.total_steps = spec.epochs * self.steps_per_epoch
        if spec.max_steps:
            self.total_steps = min(self.total_steps, spec.max_steps)
        self.groups = [r.group for r in ctx.ranks]
        self.tb = None
        if ctx.rank == 0:
            # What an earlier generation logged after the step resumed from is gone from the
            # curves (TensorBoard drops steps >= purge_step); the resumed step's own stays.
            # From step 0 on, everything goes (a restart before the first checkpoint).
            self.tb = TBLogger(ctx.logdir, ctx.app_id, purge_step=self.start_step + 1 if self.start_step else 0,
                               sync_every=ctx.job.tensorboard.sync_every, hparams=self._hparams(),
                               scratch=ctx.workdir, continue_from=self._resumed_run())
        self.last_ckpt_time = time.monotonic()
        self.cgroup = memory.own_cgroup()
        self.rss_peak = 0
        # in every progress record: what this run went on from (submit --wait says it as it starts)
        self.resumed = {"resumed_from": self.start_step, "resumed_app": self.ckpt.resumed_app or ctx.app_id} \
            if self.start_step else {}
        self.slowdown = Slowdown(ctx.ranks)

    def _hparams(self):
        s = self.spec
        return {"strategy": s.strategy.name, "model": s.model, "batch_size": s.batch_size, "lr": s.lr,
                "optimizer": s.optimizer, "world_size": self.ctx.world_size, "seed": s.seed,
                "groups": ",".join(f"{g.instances}x{g.name}({g.vcores:g}vc)" for g in self.ctx.job.groups)}

    # -- pieces of the loop ----------------------------------------------------
    def evaluate(self):
        if self.test is None:
            return {}
        B = self.spec.batch_size
        lo, hi = self.strategy.batch_slice(B)
        loader = self.test.batches(B, lo, hi, seed=self.spec.seed, epochs=1, drop_last=False, train=False)
        self.strategy.before_eval()
        sums = np.zeros(3)
        for _, _, x, y in loader:
            loss_sum, correct, n = self.strategy.eval_step(x, y)
            sums += (loss_sum, correct, n)
            self.ctx.heartbeat()
        loader.close()
        total = self.comm.allreduce(sums)
        return {"loss": total[0] / max(total[2], 1), "accuracy": total[1] / max(total[2], 1)}

    def checkpoint_due(self, step):
        c = self.ctx.job.checkpoint
        due = bool(c.every_steps and step % c.every_steps == 0)
        if c.every_seconds and not due:     # rank 0's clock decides; a polite wait where throttled
            flag = np.array([self.ctx.rank == 0 and time.monotonic() - self.last_ckpt_time >= c.every_seconds],
                            dtype=np.uint8)
            collectives.wait(self.comm.Ibcast(flag, root=0))
            due = bool(flag[0])
        return due

    def _resumed_run(self):
        """The TensorBoard run of the application this one resumed, where each logs in its own
        directory (tensorboard.logdir unset): this run continues its curves. (With a logdir set,
        the two runs sit side by side in it.)"""
        app, ctx = self.ckpt.resumed_app, self.ctx
        mine = f"/{ctx.app_id}/tensorboard"         # <apps>/<app id>/tensorboard: the others beside it
        if not app or ctx.job.tensorboard.logdir or ctx.generation or not ctx.logdir.rstrip("/").endswith(mine):
            return None             # (a restart: its run has them already)
        return f"{ctx.logdir.rstrip('/')[:-len(mine)]}/{app}/tensorboard/{app}"

    def _data(self):
        return {"batch_size": self.spec.batch_size, "train_rows": len(self.train), "seed": self.spec.seed,
                "order": self.train.order.fingerprint(self.spec.batch_size)}

    def _job_hyperparameters(self):
        """The job's lr, momentum and weight decay over those of the checkpoint's optimizer
        state (load_state_dict puts back its param_groups' settings: a resume with lr 0.01, or
        5.0, trained on with the first job's 0.05, bit for bit, while job.json said 0.01).
        Said once by rank 0 where one changed."""
        want = {"lr": self.spec.lr, "weight_decay": self.spec.weight_decay, "momentum": self.spec.momentum}
        field = {"lr": "training.lr", "weight_decay": "training.weight_decay", "momentum": "training.momentum"}
        changed = {}
        for group in getattr(getattr(self.strategy, "optimizer", None), "param_groups", ()):
            for k, v in want.items():
                if k in group and group[k] != v:            # (Adam has no momentum)
                    changed[k] = (group[k], v)
                    group[k] = v
        if changed and self.ctx.rank == 0:
            log.warning("resumed with this job's %s (the checkpoint of step %d was trained with %s)",
                        ", ".join(f"{field[k]} {new:g}" for k, (_, new) in changed.items()), self.start_step,
                        ", ".join(f"{old:g}" for old, _ in changed.values()))

    def _check_same_job(self, state, ctx):
        """Refuse to resume a checkpoint written by a job of another strategy or model, or for
        another batch size or training set (not retried: every attempt reads the same)."""
        app = self.ckpt.resumed_app or ctx.app_id
        line = other_model(self.start_step, app, state.get("trains"), self.trains)
        if line:
            raise _not_retried(line)
        saved, now = state.get("data"), self._data()
        line = other_data(self.start_step, app, saved, now)
        if line and app == ctx.app_id:      # its own checkpoint, as a restart resumes: the data changed
            how = "" if saved["train_rows"] != now["train_rows"] else ", in another order: its files rewritten"
            raise DataChanged(              # (the line spoke of checkpoint.resume, which nobody set)
                f"training.data.train: the training set changed while the job ran ({saved['train_rows']} rows "
                f"when it started, {now['train_rows']} now{how}), and its checkpoint of step {self.start_step} "
                f"stands for a place in the data it started with{DataChanged.CHANGED}")
        if line:
            raise _not_retried(line)

    def save(self, step):
        state = self.strategy.state_dict()
        if self.comm.allreduce(int(not _finite(state))):      # (every rank saves, or none)
            raise self._diverged(f"its weights held nan or inf at step {step} (of {self.total_steps}), where a "
                                 f"checkpoint was due (none was written)")
        self.ckpt.save(step, {"step": step, "strategy": state, "rng": rng_state(),
                              "data": self._data(), "trains": self.trains})

    def _diverged(self, what):
        spec = self.spec
        advice = (f"lower training.lr ({spec.lr:g} now)" if spec.precision != "fp16" else
                  f"lower training.lr ({spec.lr:g} now), or train in training.precision bf16 or fp32 (fp16 "
                  f"overflows past 65504)")
        return Diverged(f"training diverged: {what}: {advice}, or look for nan or inf in the features of "
                        f"training.data.train")
        self.last_ckpt_time = time.monotonic()

    def resources(self):
        """This rank's data reads and its container's memory (peaks, MiB), for status and
        benchmarks: the cgroup's limit and peak (with page cache), its anonymous + mapped
        memory sampled at every progress record, and this process's own peak RSS."""
        import resource
        st, mem = self.loader.stats, memory.state(self.cgroup) or {}
        mib = (lambda b: round(b / 2 ** 20, 1) if b and b < 1 << 60 else None)     # (no limit: 2^63)
        return {"data_read_mb": round(st.bytes_read / 1e6, 3), "data_rereads": st.rereads,
                "data_blocks_peak_mib": mib(st.peak_bytes), "memory_limit_mib": mib(mem.get("limit")),
                "memory_peak_mib": mib(mem.get("peak")), "container_rss_peak_mib": mib(self.rss_peak),
                "rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}

    def _warn_rereads(self, epochs):
        """Say where this rank read blocks again more often than the dataset has blocks in
        each of the `epochs` it trained: its data memory is too small for the shuffle window
        (an audit's 1 GiB window in 1 GiB containers: 503 blocks read again in 8 steps, said
        by `status --json` alone)."""
        layout = getattr(self.train, "layout", None)          # a dataset of the user's has no blocks
        st, blocks = self.loader.stats, len(layout.blocks) if layout else 0
        if layout and st.rereads > blocks * max(1.0, epochs):
            log.warning("rank %d read blocks of training.data.train again %d times (it has %d blocks; %.0f MB read): "
                        "its data memory (training.data.memory, %d MiB) holds too little of a shuffle window of "
                        "%d MiB; lower training.data.shuffle_window, or raise training.data.memory (and the "
                        "group's memory)", self.ctx.rank, st.rereads, blocks, st.bytes_read / 1e6,
                        self.train.budget >> 20, self.train.window >> 20)

    def epochs(self, step):
        """Epochs done at `step`, as a fraction (1.36: a third of the way into the second), in
        every record: a run that max_steps stops mid-epoch read "epoch=2" after 1.4 epochs."""
        return round(step / self.steps_per_epoch, 2)

    def log_window(self, step, window):
        """Aggregate the timings of the last steps over the world; rank 0 logs them."""
        self.rss_peak = max(self.rss_peak, memory.resident(self.cgroup) or 0)
        n = max(window["steps"], 1)
        mine = np.array([window["compute"] / n, window["comm"] / n, window["wait"] / n, window["wall"] / n])
        every = self.comm.gather(mine, root=0)
        rec = {"step": step, "total_steps": self.total_steps, "epoch": self.epochs(step),
               "loss": window["loss"] / n, "accuracy": window["correct"] / max(window["samples"], 1),
               "samples_per_s": window["samples"] / max(window["wall"], 1e-9)}
        if self.ctx.rank == 0:
            scal = {"train/loss": rec["loss"], "train/accuracy": rec["accuracy"],
                    "train/samples_per_s": rec["samples_per_s"], "train/lr": self.spec.lr,
                    "train/epoch": rec["epoch"]}
            for g in dict.fromkeys(self.groups):
                rows = np.array([every[r] for r, gg in enumerate(self.groups) if gg == g])
                c, m, w, wall = rows.mean(axis=0)
                scal.update({f"time/compute/{g}": c, f"time/comm/{g}": m, f"time/data_wait/{g}": w,
                             f"time/step/{g}": wall, f"time/data_wait_pct/{g}": 100 * w / max(wall, 1e-9)})
            scal.update(self.strategy.scalars())
            self.tb.scalars(step, scal)
            self.slowdown.look(every)
        self.ctx.report(**rec, **self.resumed)
        return rec

    # -- the loop -------------------------------------------------------------
    def run(self):
        ctx, spec = self.ctx, self.spec
        step = self.start_step
        t_start = time.perf_counter()
        window = dict.fromkeys(("steps", "loss", "correct", "samples", "compute", "comm", "wait", "wall"), 0.0)
        totals = dict.fromkeys(("samples", "wait", "wall"), 0.0)
        ctx.report(step=step, total_steps=self.total_steps, epoch=self.epochs(step), **self.resumed)
        t_prev = time.perf_counter()
        rec, not_a_number = {}, 0
        for _, s, x, y in self.loader:
            if step >= self.total_steps:
                break
            t_got = time.perf_counter()
            st = self.strategy.train_step(x, y)
            step += 1
            t_done = time.perf_counter()
            not_a_number = 0 if math.isfinite(st.loss) else not_a_number + 1      # (alike on every rank)
            if not_a_number >= DIVERGED_STEPS:
                raise self._diverged(f"the loss was {st.loss} for {not_a_number} steps in a row (steps "
                                     f"{step - not_a_number + 1}-{step} of {self.total_steps})")
            ctx.heartbeat()
            wall = t_done - t_prev
            for k, v in (("steps", 1), ("loss", st.loss), ("correct", st.correct), ("samples", st.samples),
                         ("compute", st.compute_s), ("comm", st.comm_s), ("wait", t_got - t_prev), ("wall", wall)):
                window[k] += v
            if step > self.start_step + 1 or step == self.total_steps:     # see `final` below
                totals["samples"] += st.samples
                totals["wait"] += t_got - t_prev
                totals["wall"] += wall
            t_prev = t_done
            if step % spec.log_every == 0 or step == self.total_steps:
                rec = self.log_window(step, window)
                window = dict.fromkeys(window, 0.0)
            end_of_epoch = step % self.steps_per_epoch == 0
            if end_of_epoch and step < self.total_steps:
                ev = self.evaluate()
                if self.tb and ev:
                    self.tb.scalars(step, {f"eval/{k}": v for k, v in ev.items()})
            if self.checkpoint_due(step) and step < self.total_steps:
                self.save(step)
            t_prev = time.perf_counter()
        self.loader.close()
        self._warn_rereads(self.epochs(step) - self.epochs(self.start_step))
        ev = self.evaluate()
        train_time = time.perf_counter() - t_start
        # Rates over the steps after this attempt's first, which pays what is paid once
        # (CUDA's and cuDNN's start, the first reads): a short run's rate is its steady one.
        steps_trained = step - self.start_step
        if not steps_trained:     # resumed from the end (`--resume latest` of a finished job): no rates to give
            log.warning("the checkpoint of step %d is the end of training (%d steps): nothing left to train; "
                        "evaluated it", step, self.total_steps)
        final = {"accuracy": ev.get("accuracy"), "loss": ev.get("loss"), "train_loss": rec.get("loss"),
                 "steps": step, "trained_steps": steps_trained,
                 "samples_per_s": totals["samples"] / max(totals["wall"], 1e-9) if steps_trained else None,
                 "data_wait_pct": 100 * totals["wait"] / max(totals["wall"], 1e-9) if steps_trained else None,
                 "time_s": train_time, "resumed_from": self.start_step, "resumed_app": self.ckpt.resumed_app}
        final = {k: v for k, v in final.items() if v is not None}
        self.save(step)
        self.ckpt.save_model(self.strategy.model_for_export(), trained.card(self.spec, self.train))
        final["model_uri"] = self.ckpt.final_uri()      # (status --json: where a script finds it)
        self.strategy.close()
        if self.tb:
            self.tb.scalars(step, {f"eval/{k}": v for k, v in ev.items()})
            self.tb.close(final, step=step)
        # the last record: training's loss and accuracy as before, and the test set's beside them
        # (under the same names they read as training getting worse)
        ctx.report(step=step, total_steps=self.total_steps, epoch=self.epochs(step),
                   **{k: v for k, v in rec.items() if k in ("loss", "accuracy")},
                   **{f"test_{k}": v for k, v in ev.items() if k in ("loss", "accuracy")},
                   **{k: final[k] for k in ("samples_per_s",) if k in final}, **self.resources(), **self.resumed)
        ctx.final(**final)
        return final


def main(ctx):
    return Runner(ctx).run()


class Slowdown:
    """Rank 0 names, once, a rank that slowed down while training: its compute per step grew
    SLOWED_X times over its best, and the step STEP_X times over the best step, in two
    windows in a row (a pause in one is noise). Its best: the least, since the warm-up, of the
    medians of three windows in a row (a window may be one step: log_every 1, and one fast
    step is no standard).
    A container throttled to a hundredth of its CPU (a quota written from outside, a host
    taken by others) made every step 50-100 times slower, and nothing said which (the
    shares, and conv-MP's split at its least, leave it its part). Measured against its first
    window instead, a rank on a host busy as training began (the tracker's CI: all-reduces
    of 100 ms) was never named when its quota was cut to a tenth later."""
    SLOWED_X, STEP_X, TYPICAL = 4.0, 3.0, 3

    def __init__(self, ranks):
        self.ranks, self.windows, self.said = ranks, 0, set()
        self.recent = collections.deque(maxlen=self.TYPICAL)    # the last windows' (step, computes)
        self.best = None        # (the best step, each rank's best compute): least of the medians of recent
        self.slow = set()       # the ranks slow in the last window (two in a row are named: one is noise)

    def look(self, every):
        """every: each rank's [compute, comm, data wait, wall] seconds a step in this window."""
        wall, compute = max(e[3] for e in every), [e[0] for e in every]
        self.windows += 1
        if self.windows < 2:        # (the first window holds the warm-up)
            return
        best = self.best
        self.recent.append((wall, compute))
        if len(self.recent) == self.TYPICAL:
            typical = (float(np.median([w for w, _ in self.recent])),
                       np.median([c for _, c in self.recent], axis=0).tolist())
            self.best = typical if best is None else (min(best[0], typical[0]),
                                                      [min(b, t) for b, t in zip(best[1], typical[1])])
        if best is None:
            return
        grew = [c / max(b, 1e-6) for c, b in zip(compute, best[1])]
        slow = {r for r, g in enumerate(grew) if g >= self.SLOWED_X} if wall >= self.STEP_X * best[0] else set()
        twice, self.slow = (slow & self.slow) - self.said, slow
        if not twice:
            return
        r = max(twice, key=grew.__getitem__)
        self.said.add(r)
        log.warning("rank %d (%s) slowed down: its compute takes %.0f ms a step, %.0fx its best since it began "
                    "(%.1f ms), and every step %.0fx longer (%.0f ms): its container gets less CPU than when "
                    "training began (a throttled or busy host?), and every rank waits for it each step", r,
                    self.ranks[r].container, 1e3 * compute[r], grew[r], 1e3 * best[1][r], wall / best[0],
                    1e3 * wall)

