"""Horovod's names in training.dist, so that a Horovod script ports by its import line
(`import training.dist as hvd`): the reduce ops (`hvd.Average`, `hvd.Sum`), compression
(`hvd.Compression.none`), a tensor's allgather and broadcast, `is_initialized`,
`shutdown`, `cross_rank`, `cross_size`, the build queries. What training.dist does not
offer is said in one line naming what to do instead (`missing`, the module's __getattr__),
not a bare AttributeError after the training ran; the client reads the same table before
submitting and warns of a use (yarnapp.codecheck).
"""
import os

import torch

from . import stalls

Average = "Average"        # Horovod's reduce ops
Sum = "Sum"
Adasum = "Adasum"


class Compression:
    """Horovod's gradient compression. Gradients go over the wire in fp32 here (the sum is
    exact to the bit from run to run): `none` only."""
    none = "none"
    fp16 = "fp16"


# Horovod's values training.dist has but refuses where they are passed, and a keyword of
# DistributedOptimizer it takes with its default only (a literal, as NOT_OFFERED below).
NOT_OFFERED_USES = {
    "Adasum": "give op=Average or op=Sum",
    "Compression.fp16": "gradients go over the wire in fp32 here: Compression.none",
    "backward_passes_per_step": "add up the micro-batches' losses and call backward() once per step",
}

# Horovod's names training.dist does not offer, and what a port does instead (a literal:
# yarnapp.codecheck reads it from this file's source at submit).
NOT_OFFERED = {
    "join": "every rank must run the same steps; ShareSampler gives each rank the same number of batches",
    "SyncBatchNorm": "BatchNorm keeps per-rank statistics as in Horovod by default; for synchronized ones call "
                     "ctx.init_process_group() and use torch.nn.SyncBatchNorm",
    "allreduce_async": "call allreduce (the gradients' sums already overlap backward in DistributedOptimizer)",
    "allreduce_async_": "call allreduce_ (the gradients' sums already overlap backward in DistributedOptimizer)",
    "grouped_allreduce": "call allreduce on each tensor, or on torch.cat of them",
    "synchronize": "there are no handles to wait for: every call here returns complete",
    "poll": "there are no handles to poll: every call here returns complete",
    "alltoall": "use allgather_object and keep your part",
    "reducescatter": "use allreduce and keep your slice",
    "elastic": "a failed rank is restarted with its world (max_restarts), your script from its start: resume "
               "from your own snapshot under $YARNAPP_CHECKPOINT_URI (docs/own-code.md)",
    "start_timeline": "what your code reports (training.dist.report) goes to TensorBoard (tensorboard.logdir, "
                      "`yarnapp tensorboard APP`); no timeline of the sums themselves",
    "stop_timeline": "what your code reports (training.dist.report) goes to TensorBoard (tensorboard.logdir, "
                     "`yarnapp tensorboard APP`); no timeline of the sums themselves",
    "Min": "allgather_object the values and take min() (the ops here: Average, Sum)",
    "Max": "allgather_object the values and take max() (the ops here: Average, Sum)",
    "Product": "allgather_object the values and multiply them (the ops here: Average, Sum)",
    "allgather_async": "call allgather: every call here returns complete",
    "broadcast_async": "call broadcast: every call here returns complete",
    "broadcast_async_": "call broadcast_: every call here returns complete",
    "ProcessSet": "every collective here spans the whole world",
    "add_process_set": "every collective here spans the whole world",
    "global_process_set": "every collective here spans the whole world",
}


def missing(name):
    """The AttributeError for Horovod's `name` where training.dist lacks it (or None)."""
    if name in NOT_OFFERED:
        return AttributeError(f"training.dist has no {name} (Horovod's): {NOT_OFFERED[name]} (docs/own-code.md)")
    return None


def average_of(op, average, where):
    """`average` as Horovod's `op` gives it (None: `average` stands)."""
    if op is None or op == Average:
        return True if op == Average else average
    if op == Sum:
        return False
    raise ValueError(f"{where}: op={op!r} is not offered (Horovod's Adasum, Min, Max...); give training.dist.Average "
                     "or training.dist.Sum")


def check_compression(compression, where):
    if compression not in (None, Compression.none):
        raise ValueError(f"{where}: compression={compression!r} is not offered: gradients are summed in fp32, exactly "
                         "and in a fixed order; give training.dist.Compression.none or leave it out")


class _Allgather(torch.autograd.Function):
    """The gradients of the gathered tensor summed over the world, this rank's rows of them
    (every rank's loss that used its rows): the gradient one process computes. (Horovod
    summed them until 0.22; it averages them since.)"""

    @staticmethod
    def forward(fn, tensor, run):
        fn.run, fn.shape = run, tensor.shape
        out, fn.start, fn.rows = _gather(tensor, run)
        return out

    @staticmethod
    def backward(fn, grad):
        return _summed(grad, fn.run, "allgather's backward").narrow(0, fn.start, fn.rows).reshape(fn.shape), None


class _Broadcast(torch.autograd.Function):
    """The root's tensor takes the gradients summed over the world, the others' none (as
    _Allgather, a sum where Horovod since 0.22 averages)."""

    @staticmethod
    def forward(fn, tensor, root_rank, run):
        fn.run, fn.root = run, root_rank
        return broadcast_(tensor.detach().clone(), root_rank, ctx=run)

    @staticmethod
    def backward(fn, grad):
        total = _summed(grad, fn.run, "broadcast's backward")
        return (total if fn.run.rank == fn.root else torch.zeros_like(total)), None, None


class Allreduce(torch.autograd.Function):
    """Horovod's gradient: the gradients reduced as the tensor was (op and factors alike)."""

    @staticmethod
    def forward(fn, tensor, average, run, prescale_factor, postscale_factor):
        fn.args = average, run, prescale_factor, postscale_factor
        return _summed(tensor, run, "allreduce", average, prescale_factor, postscale_factor)

    @staticmethod
    def backward(fn, grad):
        average, run, pre, post = fn.args
        return _summed(grad, run, "allreduce's backward", average, pre, post), None, None, None, None


def _summed(tensor, run, what, average=False, prescale_factor=1.0, postscale_factor=1.0):
    """`tensor` summed (or averaged) over the world, a new tensor; the call named `what`
    (training.stalls: a rank waiting in a backward's, its peers elsewhere, is told apart
    from one in the user's own allreduce)."""
    from .dist import reduce_into
    return reduce_into(tensor.detach().clone(), average, run, prescale_factor, postscale_factor, what)


def differentiable(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def allgather(tensor, name=None, ctx=None):
    """Horovod's: every rank's `tensor` concatenated along its first dimension, in rank
    order (their first dimensions may differ). Collective. Differentiable (a contrastive
    loss over every rank's embeddings): backward sums the gathered tensor's gradients over
    the world, and each rank takes its own rows, so every rank must call backward.
    (`name`: Horovod's, unused.)"""
    from .dist import context
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allgather: expected a tensor, got {type(tensor).__name__}; allgather_object takes "
                        "any object")
    run = ctx or context()
    return _Allgather.apply(tensor, run) if differentiable(tensor) else _gather(tensor, run)[0]


def _gather(tensor, run):
    """(every rank's tensor concatenated, the first of this rank's rows in it, their number)."""
    with stalls.collective(run, "allgather") as comm:
        parts = comm.allgather(tensor.detach().cpu())
    rows = [p.shape[0] if p.dim() else 1 for p in parts]
    out = torch.cat([p.reshape(1) if p.dim() == 0 else p for p in parts]).to(tensor.device)
    return out, sum(rows[:run.rank]), rows[run.rank]


def broadcast_(tensor, root_rank=0, name=None, ctx=None):
    """Horovod's: overwrite `tensor`, in place, with root_rank's. Collective."""
    from .dist import _root, context
    from .devices import bcast_
    ctx = ctx or context()
    root_rank = _root(root_rank, ctx)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"broadcast_: expected a tensor, got {type(tensor).__name__}; broadcast_object takes any "
                        "object")
    wire = tensor.float() if tensor.dtype == torch.bfloat16 else tensor     # (no MPI type for bf16)
    with stalls.collective(ctx, f"broadcast(root_rank={root_rank})") as comm:
        if tensor.numel():
            with torch.no_grad():
                bcast_(comm, wire, root=root_rank)
                if wire is not tensor:
                    tensor.copy_(wire)
    return tensor


def broadcast(tensor, root_rank=0, name=None, ctx=None):
    """Horovod's: a new tensor holding root_rank's `tensor`. Collective. Differentiable:
    backward gives root_rank's tensor the gradients summed over the world (every rank must
    call backward), the others' zero."""
    from .dist import context
    if differentiable(tensor):
        return _Broadcast.apply(tensor, root_rank, ctx or context())
    return broadcast_(tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor, root_rank, name, ctx)


def is_initialized():
    """Whether init() ran in this process (any call of the API runs it)."""
    from . import dist
    return dist._ctx is not None


def shutdown():
    """Horovod's: nothing to do; the launcher ends the world when the rank's code ends."""


def cross_rank():
    """Horovod's: the index of this rank's host (torchrun's group rank)."""
    from .dist import context
    return context().group_rank


def cross_size():
    """Horovod's: the number of hosts the world spans (torchrun's GROUP_WORLD_SIZE)."""
    from .dist import context
    context()
    return int(os.environ.get("GROUP_WORLD_SIZE") or 1)


def nccl_built():
    """Horovod's build query: the collectives here run over MPI (GPU tensors staged through
    host memory), not NCCL."""
    return False


def gloo_built():
    return False


def mpi_built():
    return True


def mpi_enabled():
    return True


def mpi_threads_supported():
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE
