"""How many kernels each rank gets: measured conv speed, split in proportion.

A distributed conv step ends when the slowest rank has finished its share, so the
step is shortest when rank r's share c_r is proportional to its speed s_r (kernels per
second on that layer): then every rank needs c_r / s_r = C / Σ s time. The layers
between convs run on the master alone and lie on the critical path whatever the split,
so they do not enter it.

Speeds are measured on the real layer shapes: each distributable conv, at the job's
batch size, on this rank's device and thread count, forward + backward (dW, db, and dX
where an earlier layer needs it), with a probe of the kernels sized like this rank's
share but bounded in work, repeated until at least `min_time` has passed so that a CPU
quota's on/off periods (cgroup CFS, 100 ms) average out.
"""
import contextlib
import copy
import dataclasses
import logging
import math
import time

import torch
import torch.nn.functional as F

from .layers import conv_padding

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """A conv layer as the calibration needs it: geometry, input shape, kernels."""
    name: str
    in_shape: tuple          # (N, C, H, W) at the job's batch size
    out_channels: int
    kernel_size: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    bias: bool
    needs_input_grad: bool   # an earlier layer needs dX (false for a conv on the data)

    def flops_per_kernel(self):
        """Multiply-adds ×2 of forward + backward for one output channel."""
        n, c, h, w = self.in_shape
        ho, wo = [(d + 2 * p - dl * (k - 1) - 1) // s + 1 for d, p, dl, k, s in
                  zip((h, w), self.padding, self.dilation, self.kernel_size, self.stride)]
        fwd = 2 * n * ho * wo * c * self.kernel_size[0] * self.kernel_size[1]
        return fwd * (3 if self.needs_input_grad else 2)


def conv_shapes(model, sample_shape, batch, names):
    """ConvShape of each named nn.Conv2d of `model` for an input batch of `batch` samples
    of `sample_shape` (C, H, W), found by one forward pass on the meta device (no compute,
    no memory), or at batch 1 on the CPU for a model with an op the meta device lacks."""
    try:
        found, modules = _input_shapes(model, names, torch.zeros((batch, *sample_shape), device="meta"))
    except (RuntimeError, NotImplementedError):
        found, modules = _input_shapes(model, names, torch.zeros((1, *sample_shape)))
    out = []
    for name in names:
        if name not in found:
            from training.strategies.base import StrategyError
            raise StrategyError(f"conv_model_parallel: conv layer {name!r} is never called in the model's forward "
                                f"(is its weight used directly, as F.conv2d(x, self.{name}.weight)?); leave it out: "
                                f"training.strategy.layers lists the layers to distribute")
        shape, needs_grad = found[name]
        conv = modules[name]
        out.append(ConvShape(name=name, in_shape=(batch, *shape[1:]), out_channels=conv.out_channels,
                             kernel_size=tuple(conv.kernel_size), stride=tuple(conv.stride),
                             padding=conv_padding(conv), dilation=tuple(conv.dilation),
                             bias=conv.bias is not None, needs_input_grad=needs_grad))
    return out


def _input_shapes(model, names, x):
    """{name: (input shape, input requires grad)} of the named modules of a copy of
    `model` moved to x's device, after one forward pass on x."""
    probe = copy.deepcopy(model).to(x.device)
    modules = dict(probe.named_modules())
    found = {}

    def hook(name):
        def record(module, args):
            found[name] = (tuple(args[0].shape), bool(args[0].requires_grad))
        return record

    handles = [modules[name].register_forward_pre_hook(hook(name)) for name in names]
    try:
        probe(x)
    finally:
        for h in handles:
            h.remove()
    return found, modules


@contextlib.contextmanager
def num_threads(n):
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_speed(shape, share, device="cpu", threads=None, min_time=0.3, work=4e9, min_probe=16):
    """Kernels per second this process computes for `shape` (forward + backward).

    share: the kernels this rank would roughly own (C / world size); the probe uses that
    many, capped so one repetition is about `work` flops but never below min_probe.
    """
    device = torch.device(device)
    probe = max(1, min(share, shape.out_channels,
                       max(min_probe, int(work // max(1, shape.flops_per_kernel())))))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape.in_shape, generator=g).to(device).requires_grad_(shape.needs_input_grad)
    w = torch.randn((probe, shape.in_shape[1], *shape.kernel_size), generator=g).to(device).requires_grad_()
    b = torch.zeros(probe, device=device, requires_grad=True) if shape.bias else None

    def once():
        y = F.conv2d(x, w, b, shape.stride, shape.padding, shape.dilation)
        y.backward(torch.ones_like(y))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with num_threads(threads):
        once()  # warm-up: allocator, kernel selection
        reps, t0 = 0, time.perf_counter()
        while True:
            once()
            reps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time and reps >= 2:
                break
    speed = probe * reps / elapsed
    log.debug("calibrate %s: %d kernels x %d reps in %.3fs = %.1f kernels/s",
              shape.name, probe, reps, elapsed, speed)
    return speed


def measure_speeds(shapes, world_size, device="cpu", threads=None, min_time=0.3):
    """This rank's speed (kernels/s) on every layer of `shapes`, in order."""
    return [measure_speed(s, math.ceil(s.out_channels / world_size), device, threads, min_time)
            for s in shapes]


def kernel_block(device="cpu"):
    """Output channels a convolution on `device` computes as one vector block.

    oneDNN, which runs torch's CPU convolutions, lays channels out in blocks of the vector
    width (16 floats with AVX-512, 8 with AVX2) and pads the last one: on an AVX-512 core,
    one thread, batch 16, the seed network's conv2 (128 inputs) with 194 kernels costs as
    much as with 208, and its conv1 with 65 kernels 1.5x as much as with 64 (forward +
    backward). Kernel shares in whole blocks waste none of it. 1 (no blocking assumed) on
    a GPU and on other CPUs. Read from ATen's CPU capability (ATEN_CPU_CAPABILITY can
    lower it); oneDNN chooses its own vector width, and small convs it does not run keep
    the estimate only as a cost model.
    """
    if torch.device(device).type != "cpu":
        return 1
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 1)


PARTIAL_BLOCK = 0.25   # the share of a partial block's missing kernels it still saves (share_cost)


def share_cost(kernels, block):
    """What a share of `kernels` costs, in kernels, when computed in blocks of `block`:
    a partial last block costs nearly a whole one (AVX-512, one thread, batch 32, a 5x5
    conv of 32 inputs: 19 kernels 8.9 ms, 24 9.2 ms, 32 9.3 ms; 8 kernels 6.8 ms, 16
    8.1 ms; forward + backward)."""
    whole = -(-int(kernels) // block) * block
    return whole - PARTIAL_BLOCK * (whole - int(kernels))


def slowest(split, speeds, block=1):
    """The split's slowest rank: max_r share_cost(c_r) / s_r."""
    return max(share_cost(c, block) / s for c, s in zip(split, speeds))


def proportional_split(kernels, speeds, block=1):
    """Integers c_r ≥ 1 with Σ c_r = kernels, in proportion to the speeds s_r.

    block 1: c_r as close to kernels·s_r/Σs as possible, by largest-remainder rounding
    (Hamilton): every rank gets floor of its quota, then the leftover kernels go one each
    to the largest fractional parts (ties to the lower rank). A rank whose quota rounds
    to 0 then takes one kernel from the rank most above its quota.
    block b > 1 (kernel_block), where every rank can have a whole block: the better of
    that split and the split in whole blocks (each rank at least one, handed out one
    block at a time to the rank that would finish it first, the kernels short of a
    block, kernels % b, where they cost least): the one whose slowest rank is faster by
    share_cost, whole blocks on a tie. Not the best of every integer split: with a share
    below one block (32 kernels at speeds 1 : 0.39) another can be ~15% faster by
    share_cost, whose fit is weakest there.
    Deterministic, so every rank computes the same split from the same speeds.
    """
    speeds = [float(s) for s in speeds]
    n = len(speeds)
    if n == 0:
        raise ValueError("proportional_split: no ranks")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"proportional_split: speeds must be positive numbers, got {speeds}")
    if int(kernels) != kernels or kernels < n:
        raise ValueError(f"proportional_split: {kernels} kernels cannot give each of {n} ranks at "
                         "least one; distribute fewer ranks or leave this layer undistributed")
    kernels = int(kernels)
    total = sum(speeds)
    quota = [kernels * s / total for s in speeds]
    counts = [int(math.floor(q)) for q in quota]
    order = sorted(range(n), key=lambda r: (-(quota[r] - counts[r]), r))
    for r in order[:kernels - sum(counts)]:
        counts[r] += 1
    for r in range(n):
        if counts[r] == 0:
            donor = max((d for d in range(n) if counts[d] > 1), key=lambda d: (counts[d] - quota[d], -d))
            counts[donor] -= 1
            counts[r] = 1
    if block > 1 and kernels // block >= n:
        blocks = _block_split(kernels, speeds, int(block))
        if slowest(blocks, speeds, block) <= slowest(counts, speeds, block):
            return blocks
    return counts


def _block_split(kernels, speeds, block):
    n = len(speeds)
    units = [1] * n
    for _ in range(kernels // block - n):       # greedy: optimal for min max_r units_r / s_r
        r = min(range(n), key=lambda q: ((units[q] + 1) / speeds[q], q))
        units[r] += 1
    counts = [u * block for u in units]
    rest = kernels % block
    if rest:
        def placed(r):
            return [c + (rest if q == r else 0) for q, c in enumerate(counts)]
        counts = placed(min(range(n), key=lambda r: (slowest(placed(r), speeds, block), r)))
    return counts


def corrected_speeds(speeds, split, seconds, block=1):
    """Per-layer speeds corrected by what training measured, rank by rank.

    speeds[l][r]: the speeds the current split was made from (kernels/s, or any unit per
    layer); split[l][r]: kernels; seconds[l][r]: measured conv seconds per step.
    Layer by layer, each rank's speed is scaled by sqrt(predicted / measured), where
    predicted = share_cost(split[l][r], block) / speeds[l][r] (the kernels its share
    costs in vector blocks) and measured = seconds[l][r] (its share and,
    where fused, the channel-wise chain after it): every distributed layer ends in a
    gather that waits for its slowest rank, so each layer must balance on its own, and a
    start-up calibration that misjudged one layer (a small conv timed while the machine
    was busy) is corrected where it erred; a rank under a CPU quota reports its CPU
    seconds over the quota, not its wall time (ConvModelParallelStrategy._share_seconds).
    A rank slower in training than predicted gets a smaller share, a faster one a
    larger. The square root damps the correction, so a speed that depends on the share
    settles instead of oscillating. Only ratios between ranks matter.
    """
    layers = list(speeds)
    ranks = len(speeds[layers[0]])
    out = {l: list(speeds[l]) for l in layers}
    for l in layers:
        for r in range(ranks):
            predicted, measured = share_cost(split[l][r], block) / speeds[l][r], seconds[l][r]
            if predicted > 0 and measured > 0:
                out[l][r] = speeds[l][r] * math.sqrt(predicted / measured)
    return out


RESHARD_GAIN = 0.02   # a layer is resharded only when its predicted time drops by more than this


def worth_resharding(old, new, speeds, gain=RESHARD_GAIN, block=1):
    """Whether moving a layer from split `old` to `new` pays: its predicted time, the
    slowest rank's share_cost(c_r) / s_r under the corrected `speeds`, drops by more than
    `gain`. Resharding moves weights and optimizer state, and a kernel or two either way
    is within the timing noise: without this, equal ranks reshard back and forth every
    recalibration."""
    return slowest(new, speeds, block) < (1.0 - gain) * slowest(old, speeds, block)

