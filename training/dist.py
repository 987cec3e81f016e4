"""yarnapp's API for your own training loop: shaped like Horovod's, run on yarnapp's
collectives, with what Horovod lacks — each rank's share of every global batch in
proportion to its speed, and the weighting that keeps the update exact.

    import training.dist as yd

    ctx = yd.init()                                   # in run.function, run.script or a notebook function
    sampler = yd.ShareSampler(dataset, batch_size=96, shares="vcores", seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    model = Net()
    yd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = yd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  model=model, weight=sampler.weight)
    yd.broadcast_optimizer_state(opt, root_rank=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:                           # this rank's n_r rows of a global batch
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()   # the mean over its own rows
            opt.step()                                # = one step on the whole global batch

Exactness. A global batch of B rows is split n_r rows per rank (`shares`: equal, by
vcores, by measured speed, or given weights; largest-remainder rounding). Rank r
backpropagates its own mean loss L_r, and the optimizer sums w_r grad L_r over the
ranks with w_r = n_r / B (`sampler.weight`), which is the gradient of the mean loss
over the global batch: every step equals the step one process takes on all B rows,
whatever the split. The sum runs in buckets during backward (bucketed ring
all-reduce, training.collectives.GradientReducer), in a fixed order, so runs are
bit-identical; a rank under a CPU quota waits politely instead of spinning (where every
rank is on one host, asleep until another rank starts a wait, as the runner's ranks).

It works beside torch.distributed (`ctx.init_process_group()`), which the launcher
sets up as torchrun does; the collectives here do not go through it.
"""
import contextlib
import logging
import threading

import numpy as np
import torch

from . import collectives, stalls
from . import dist_horovod as _hvd
from .context import RunContext, current, in_a_container
from .dist_shares import ShareSampler, permutation, share_weights, split_rows  # training.dist's names

log = logging.getLogger(__name__)

__all__ = ["init", "rank", "size", "local_rank", "local_size", "context", "share_weights", "split_rows", "permutation",
           "ShareSampler", "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object", "allreduce", "allreduce_", "allgather_object", "barrier", "report",
           # Horovod's names (training.dist_horovod)
           "Average", "Sum", "Compression", "allgather", "broadcast", "broadcast_", "is_initialized", "shutdown",
           "cross_rank", "cross_size", "Adasum", "nccl_built", "gloo_built", "mpi_built", "mpi_enabled",
           "mpi_threads_supported"]

_ctx = None
_optimizers = 0     # DistributedOptimizers made in this rank (names their sums: training.stalls)


def init(ctx=None):
    """Start using the API in this rank (idempotent); returns the RunContext.

    A throttled rank (fewer vcores than compute threads, e.g. 0.5) waits politely in
    every collective; torch uses the rank's threads (its vcores, rounded up). Outside a
    yarnapp container (`python train.py`, a smoke test, as Horovod's script runs without
    horovodrun) the world is this process alone (RunContext.alone), said once."""
    global _ctx
    if ctx is None and not in_a_container():
        log.warning("training.dist: not in a yarnapp container: a world of this process alone (`yarnapp submit` "
                    "runs it on the job's containers)")
        ctx = RunContext.alone()
    _ctx = ctx or current()
    collectives.set_polite(_ctx.me.throttled)
    torch.set_num_threads(_ctx.me.threads)
    return _ctx


def context():
    """The RunContext the API works in: init()'s, else (in a yarnapp rank whose code did
    not call init()) this rank's, taken as init() takes it."""
    return _ctx if _ctx is not None else init()


def rank():
    return context().rank


def size():
    return context().world_size


def local_rank():
    return context().local_rank


def local_size():
    return context().local_world_size


def device():
    """Where this rank should compute: cuda:0 when its container has GPUs (its
    CUDA_VISIBLE_DEVICES holds exactly its own), else the CPU. Put the model and the
    batches there; DistributedOptimizer stages GPU gradients through host memory."""
    return context().device


def report(**metrics):
    """Publish this rank's progress (`yarnapp status`, `submit --wait`); also a heartbeat."""
    context().report(**metrics)


# -- the optimizer -----------------------------------------------------------------------

_REDUCED = torch.utils.weak.WeakIdKeyDictionary()    # parameter -> the GradientReducer that sums its gradients


def _params(model, named_parameters, optimizer):
    if model is not None:
        return [p for p in model.parameters()]
    if named_parameters is not None:
        return [p for _, p in named_parameters]
    return [p for g in optimizer.param_groups for p in g["params"]]


def DistributedOptimizer(optimizer, named_parameters=None, model=None, weight=None, bucket_mb=4.0,
                         ring_threshold_kb=256.0, shared_memory=True, ctx=None, backward_passes_per_step=1,
                         op=None, compression=None, gradient_predivide_factor=1.0, sparse_as_dense=False,
                         groups=None, num_groups=0):
    """Make `optimizer` step on the gradient summed over the world; returns it.

    Every rank's gradients are weighted by `weight` (default 1/size, Horovod's average;
    give `sampler.weight` for unequal shares) and summed in buckets by ring all-reduce
    while backward runs. As with torch's DistributedDataParallel, the sum is complete
    when `backward()` returns: gradients may be clipped, scaled or inspected before
    `optimizer.step()`, and are the same on every rank. Horovod's
    `optimizer.synchronize()` and `with optimizer.skip_synchronize():` are there too
    (nothing is left for them to do). Call backward once per step (Horovod's
    backward_passes_per_step: 1 only). Parameters may be
    frozen or unfrozen between steps (fine-tuning), on every rank alike. The optimizer stays
    what it was (schedulers, state_dict and isinstance keep working): hooks do the work.
    Collective: every rank calls it, once per optimizer and model.

    Horovod's arguments: op=Average (the default) or Sum (weight 1: the plain sum);
    compression=Compression.none; gradient_predivide_factor, sparse_as_dense, groups and
    num_groups are taken and change nothing (the sum is dense, bucketed, divided once).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                        f"wrap the optimizer: DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=...), "
                        f"model=model)")
    if backward_passes_per_step != 1:      # (was a bare "unexpected keyword argument" from a Horovod port)
        raise TypeError(f"DistributedOptimizer(backward_passes_per_step={backward_passes_per_step}): Horovod's "
                        f"accumulation over backward passes is not offered; add up the micro-batches' losses and "
                        f"call backward() once per step (docs/own-code.md)")
    average = _hvd.average_of(op, True, "DistributedOptimizer")
    _hvd.check_compression(compression, "DistributedOptimizer")
    if not average and weight is None:
        weight = 1.0
    if getattr(optimizer, "yarnapp_reducer", None) is not None:
        raise RuntimeError("DistributedOptimizer: this optimizer is distributed already (DistributedOptimizer "
                           "was called on it before); call it once per optimizer")
    ctx = ctx or context()
    params = _params(model, named_parameters, optimizer)
    taken = [p for p in params if p in _REDUCED]
    if taken:
        raise RuntimeError(f"DistributedOptimizer: {len(taken)} of these parameters are reduced by another "
                           f"DistributedOptimizer already (each would sum their gradients); wrap one optimizer "
                           f"per model, or leave out model= so that each wraps its own optimizer's parameters")
    weight = 1.0 / ctx.world_size if weight is None else float(weight)
    overlap = "thread" if ctx.me.vcores - torch.get_num_threads() >= 1 else "poll"
    global _optimizers
    _optimizers += 1
    sum_call = f"optimizer #{_optimizers}'s sum of gradients (backward, or step())"   # (training.stalls)
    comm = ctx.comm

    def make_reducer(trainable):        # collective (the reducer's own communicator)
        return collectives.GradientReducer(trainable, comm, bucket_mb=bucket_mb,
                                           ring_threshold_kb=ring_threshold_kb, overlap=overlap,
                                           shared_memory=shared_memory)

    def in_scope():
        """The parameters this optimizer reduces, as they are now: a model's (or the
        optimizer's groups', add_param_group's included) that no other reducer has."""
        now = params if model is None and named_parameters is not None else _params(model, None, optimizer)
        return [p for p in dict.fromkeys(now) if _REDUCED.get(p) in (None, state["reducer"])]

    with stalls.collective(ctx, "DistributedOptimizer"):
        state = {"queued": False, "reduced": False, "reducer": make_reducer(params), "changed": False,
                 "checked": False}

    def trainable_changed(reducer):
        """Parameters frozen or unfrozen since the reducer was made (fine-tuning that
        unfreezes a backbone): the newly trainable ones' gradients of this step are summed
        here, the newly frozen ones keep no gradient (as without this optimizer: no
        weight decay or momentum moves them), and the next step gets a reducer of what is
        trainable then. Every rank must find the same (checked: `agree`)."""
        scope = in_scope()
        agree([i for i, p in enumerate(scope) if p.requires_grad], reducer)
        known = set(reducer.params)
        new = [p for p in scope if p.requires_grad and p not in known]
        for p in reducer.params:
            if not p.requires_grad:
                p.grad = None
        if new:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                              .to("cpu", torch.float64) for p in new]).mul_(weight)
            collectives.allreduce_(flat, reducer.comm)
            for p, g in zip(new, flat.split([p.numel() for p in new])):
                p.grad = g.view_as(p).to(p.device, p.dtype)
        return bool(new) or any(not p.requires_grad for p in reducer.params)

    def agree(trainable, reducer):
        """Raise where the ranks disagree on which parameters are trainable (one all-reduce
        of a few integers a step): a rank that froze alone (on its own validation loss) would
        sum other tensors into its peers' or wait in a sum they never start. At the first
        step, also where their parameters are not the same bits (a hash of them): weights
        each rank drew and nobody broadcast, or a broadcast made on rank 0 alone, trained
        apart without a word."""
        if reducer.alone:
            return
        from mpi4py import MPI
        words = [hash(tuple(trainable)) & ((1 << 62) - 1)]
        first = not state["checked"]
        if first:
            state["checked"] = True
            words += _digest(in_scope())
        both = np.array(words + [-w for w in words], dtype=np.int64)
        collectives.wait(reducer.comm.Iallreduce(MPI.IN_PLACE, both, op=MPI.MAX))  # polite where throttled
        same = both[:len(words)] == -both[len(words):]
        if not same[0]:
            raise RuntimeError("the ranks disagree on which parameters are trainable this step (frozen on some "
                               "ranks, not on others): freeze and unfreeze on every rank alike (decide on rank 0 "
                               "and share the decision with training.dist.broadcast_object)")
        if first and not same.all():
            from conf.errors import YarnappError
            raise YarnappError("DistributedOptimizer: at the first step the ranks' parameters differ, and the "
                               "replicas would train apart; on every rank, before the first step, call "
                               "training.dist.broadcast_parameters(model.state_dict(), root_rank=0)")

    def synchronize():
        """Wait for the sum of this step's gradients (done by the end of backward already)."""
        if not state["reduced"]:
            reducer = state["reducer"]
            with stalls.within(ctx, sum_call):
                reducer.finish()
                state["changed"] = trainable_changed(reducer)
            state["reduced"] = True

    def at_backward_end():
        state["queued"] = False
        if torch._C._current_autograd_node() is not None:
            return      # the end of a nested backward (reentrant checkpointing): the outer one queues again
        synchronize()

    def on_grad(p):
        # once per step, finish the sum when the autograd engine ends this backward, as DDP
        # does (a parameter frozen when the reducer was made and unfrozen since has no hook
        # until the next step's reducer: where only such get gradients, step() sums them)
        if state["reduced"]:
            raise RuntimeError("a second backward before optimizer.step() or zero_grad(): its gradients would "
                               "be this rank's alone; call backward once per step (to accumulate gradients, "
                               "accumulate the loss and call backward once)")
        if not state["queued"]:
            state["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)

    hooked = torch.utils.weak.WeakIdKeyDictionary()

    def adopt(reducer):
        for p in reducer.params:
            _REDUCED[p] = reducer
            if p not in hooked:
                hooked[p] = p.register_post_accumulate_grad_hook(on_grad)
        optimizer.yarnapp_reducer = reducer

    def rearm():
        """The next step's reduction: after step(), or after a zero_grad() that follows a
        step not taken (GradScaler skips it when it finds inf). Where what is trainable
        changed, with a reducer of what is trainable now (made by every rank: collective)."""
        if state["changed"]:
            old = state["reducer"]
            trainable = [p for p in in_scope() if p.requires_grad]
            for p in old.params:
                p.grad = None           # a view of the old reducer's buckets; begin() clears the rest
                _REDUCED.pop(p, None)
            old.close()
            state["reducer"] = make_reducer(trainable)
            adopt(state["reducer"])
            state["changed"] = False
            log.info("distributed optimizer: %d parameters trainable now, in %d buckets",
                     len(trainable), len(state["reducer"].buckets))
        state["reduced"] = state["queued"] = False
        state["reducer"].begin(weight)

    def before_step(opt, args, kwargs):
        synchronize()           # a step without a backward (a rank with no rows): zeros of its own

    def after_step(opt, args, kwargs):
        ctx.heartbeat()          # progress: from now on, silence is a hang
        rearm()

    zero_grad = optimizer.zero_grad

    def zero_grad_then_rearm(*args, **kwargs):
        if state["reduced"]:    # reduced, and no step() since: a step skipped
            rearm()
        return zero_grad(*args, **kwargs)

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    optimizer.zero_grad = zero_grad_then_rearm
    adopt(state["reducer"])
    optimizer.synchronize = synchronize
    optimizer.skip_synchronize = contextlib.nullcontext
    state["reducer"].begin(weight)
    log.info("distributed optimizer: rank %d of %d, weight %.4f, %d buckets, overlap=%s",
             ctx.rank, ctx.world_size, weight, len(state["reducer"].buckets), state["reducer"].overlap)
    return optimizer


# -- broadcasts and collectives ------------------------------------------------------------

def _digest(params):
    """Two 62-bit words of a hash of the parameters' bits (any dtype, any device)."""
    import hashlib
    h = hashlib.blake2b(digest_size=16)
    for p in params:
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    d = h.digest()
    return [int.from_bytes(d[i:i + 8], "little") & ((1 << 62) - 1) for i in (0, 8)]


def _tensors(params):
    if isinstance(params, torch.nn.Module):        # broadcast_parameters(model): its state_dict, as meant
        params = params.state_dict()
    if isinstance(params, dict):
        return list(params.values())
    out = []
    for p in params:
        out.append(p[1] if isinstance(p, tuple) else p)
    return out


def _root(root_rank, ctx):
    """root_rank, checked against the world (the same line on every rank, before any MPI call)."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"root_rank: expected a rank (an int), got {type(root_rank).__name__} {root_rank!r}")
    if not 0 <= root_rank < ctx.world_size:
        raise ValueError(f"root_rank {root_rank}: the world's ranks are 0 to {ctx.world_size - 1}")
    return int(root_rank)


def broadcast_parameters(params, root_rank=0, ctx=None):
    """Overwrite, in place, every tensor of `params` (a state_dict, named_parameters or a
    list) with root_rank's. Collective."""
    from .devices import bcast_
    ctx = ctx or context()
    root_rank = _root(root_rank, ctx)
    with stalls.collective(ctx, f"broadcast_parameters(root_rank={root_rank})") as comm:
        stalls.check_root_call(ctx, root_rank, *comm.bcast(_call(ctx, root_rank), root=root_rank))
        for t in _tensors(params):
            if isinstance(t, torch.Tensor) and t.numel():
                bcast_(comm, t, root=root_rank)


def broadcast_object(obj, root_rank=0, ctx=None, name=None):
    """root_rank's `obj` on every rank (pickled). Collective. (`name`: Horovod's, unused.)"""
    ctx = ctx or context()
    root_rank = _root(root_rank, ctx)
    with stalls.collective(ctx, f"broadcast_object(root_rank={root_rank})") as comm:
        theirs, at, obj = comm.bcast((*_call(ctx, root_rank), obj), root=root_rank)
        stalls.check_root_call(ctx, root_rank, theirs, at)
        return obj


def _call(ctx, root_rank):
    """The root's (call, its line) sent with a broadcast (stalls.check_root_call)."""
    call = stalls.current() if ctx.rank == root_rank else None
    return (call, stalls.user_line(threading.get_ident())) if call else (None, None)


def broadcast_optimizer_state(optimizer, root_rank=0, ctx=None):
    """Make every rank's optimizer state (momentum buffers, step counts, lr) root_rank's."""
    ctx = ctx or context()
    root_rank = _root(root_rank, ctx)
    state = broadcast_object(optimizer.state_dict() if ctx.rank == root_rank else None, root_rank, ctx)
    if ctx.rank != root_rank:
        optimizer.load_state_dict(state)


def allreduce_(tensor, average=None, ctx=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               compression=None):
    """Sum (or average: the default) a tensor over the world, in place, in a fixed order.
    Collective. An integer tensor (a count of correct predictions) is summed exactly; its
    average has no place in it: allreduce(t) returns one. Horovod's op (Average, Sum) and
    pre/postscale factors are taken. (`name`: Horovod's, unused.)"""
    ctx = ctx or context()
    average = _hvd.average_of(op, True if average is None else average, "allreduce")
    _hvd.check_compression(compression, "allreduce")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce_: expected a tensor to reduce in place, got {type(tensor).__name__}; "
                        f"allreduce(x) takes a number and returns a tensor")
    if average and not tensor.is_floating_point():
        raise TypeError(f"allreduce_: the average of a {tensor.dtype} tensor cannot be kept in it; give "
                        f"average=False (its sum), or allreduce(t), which returns a float64 tensor")
    return reduce_into(tensor, average, ctx, prescale_factor, postscale_factor)


def reduce_into(tensor, average, ctx, prescale_factor=1.0, postscale_factor=1.0, what="allreduce"):
    """allreduce_'s work on a checked tensor; `what`: the call's name for training.stalls
    (a backward's own, for one that waits there: training.dist_horovod)."""
    wire = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else \
        torch.float32 if tensor.is_floating_point() else torch.float64      # integers: exact below 2**53
    host = tensor.detach()
    if host.device.type != "cpu" or not host.is_contiguous() or host.dtype != wire or prescale_factor != 1.0:
        host = host.to("cpu", wire, copy=True).contiguous()
    if prescale_factor != 1.0:
        host.mul_(prescale_factor)
    with stalls.collective(ctx, what) as comm:
        collectives.allreduce_(host, comm)
    if average:
        host.div_(ctx.world_size)
    if postscale_factor != 1.0:
        host.mul_(postscale_factor)
    if host.data_ptr() != tensor.data_ptr():
        with torch.no_grad():
            tensor.copy_(host)
    return tensor


def allreduce(tensor, average=None, ctx=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              compression=None):
    """A new tensor: the sum (or average: the default) of `tensor` (or a number) over the
    world; the average of integers is a float64 tensor. Collective. Horovod's op and
    pre/postscale factors as allreduce_'s. Differentiable, as Horovod's: backward reduces
    the gradients as the tensor was, so every rank must call it. (`name`: Horovod's, unused.)"""
    average = _hvd.average_of(op, True if average is None else average, "allreduce")
    _hvd.check_compression(compression, "allreduce")
    if not isinstance(tensor, torch.Tensor):
        if not isinstance(tensor, (int, float, np.number, np.ndarray)):
            raise TypeError(f"allreduce: expected a tensor or a number, got {type(tensor).__name__}")
        tensor = torch.as_tensor(tensor)
    if _hvd.differentiable(tensor):     # Horovod's gradient: the gradients reduced alike
        return _hvd.Allreduce.apply(tensor, average, ctx or context(), prescale_factor, postscale_factor)
    t = tensor.detach().clone()
    return reduce_into(t.to(torch.float64) if average and not t.is_floating_point() else t, average,
                       ctx or context(), prescale_factor, postscale_factor)


def allgather_object(obj, ctx=None, name=None):
    """[every rank's obj] in rank order. Collective. (`name`: Horovod's, unused.)"""
    with stalls.collective(ctx or context(), "allgather_object") as comm:
        return comm.allgather(obj)


def barrier(ctx=None):
    with stalls.collective(ctx or context(), "barrier") as comm:
        collectives.wait(comm.Ibarrier())


# Horovod's names (a port changes its import line only; see training.dist_horovod)
from .dist_horovod import (Adasum, Average, Compression, Sum, allgather, broadcast, broadcast_,  # noqa: E402,F401
                           cross_rank, cross_size, gloo_built, is_initialized, mpi_built, mpi_enabled,
                           mpi_threads_supported, nccl_built, shutdown)


def __getattr__(name):
    """Horovod's names not offered: one line saying what to do instead."""
    raise _hvd.missing(name) or AttributeError(f"module 'training.dist' has no attribute {name!r}")
