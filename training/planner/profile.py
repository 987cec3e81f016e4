"""Layer profiling: the compute of a model on this machine, layer by layer (a Profile).

Per layer l of the job's model at the job's batch B, forward + backward seconds t_l
(mean of repeated runs; where they add up to more than the whole model's time they are
scaled down to it, keeping their proportions), the whole model's forward + backward
with the loss t(B) and t(B/4) (an affine fit t(b) = a + (t(B) − a) b / B for row counts
not measured), and one optimizer step o over all |W| parameter bytes, for a thread
count (a rank runs k = ceil(vcores) threads). Then what the ranks will really run:
t(n_r) at every rank's row count (`measure_rows`), and each conv share (c kernels of
layer l) as a conv of c kernels on the layer's input (`measure_shares`), because
neither is proportional (here 16 rows took 2x 8 rows' time, and 21 of conv1's 32
kernels 5x 11 of them). A rank that sleeps while it waits (a throttled rank; a conv-MP
worker) is timed after 20 ms pauses (`idle_profile`: ~20% slower than back to back).
"""
import copy
import dataclasses
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from training.perf.model import Layer, Profile
from training.strategies.conv_mp import fuse
from training.strategies.conv_mp.calibrate import kernel_block, num_threads
from training.strategies.conv_mp.layers import why_not_distributable


def _timed(fn, min_time, min_reps, sync=None, idle_s=0.0):
    """Mean seconds of fn() over at least min_reps runs and min_time seconds (after a warm-up):
    the mean, because a step time is predicted as the mean of many (a job's throughput);
    runs over 3x the median (a one-off stall of the machine) are left out.
    fn may return a callable run untimed before the next repetition (resetting state)."""
    reset = fn()
    if callable(reset):
        reset()
    times = []
    while len(times) < min_reps or sum(times) < min_time:
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        reset = fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
        if callable(reset):
            reset()
    typical = statistics.median(times)
    return statistics.fmean([t for t in times if t <= 3 * typical])   # not a one-off stall


def _leaf_calls(model, x, y):
    """[(name, module, input tensor, output shape)] of every leaf module call of one
    forward pass on x, in call order (the input keeps its requires_grad flag)."""
    calls = []

    def hook(name):
        def record(module, args, output):
            inp = args[0] if args and torch.is_tensor(args[0]) else None
            if inp is not None and torch.is_tensor(output):
                calls.append((name, module, inp.detach().requires_grad_(inp.requires_grad), tuple(output.shape)))
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if name and not list(m.children())]
    try:
        F.cross_entropy(model(x), y)
    finally:
        for h in handles:
            h.remove()
    return calls


def _time_layer(module, inp, min_time, min_reps, sync, idle_s=0.0):
    """Forward + backward seconds of one module on a copy of its recorded input."""
    x0 = torch.randn_like(inp).requires_grad_(inp.requires_grad)
    params = [p for p in module.parameters() if p.requires_grad]
    probe = module(x0.clone() if x0.requires_grad else x0)
    grad = torch.randn_like(probe) if probe.requires_grad else None

    def once():
        out = module(x0.clone() if x0.requires_grad else x0)
        if grad is not None:
            out.backward(grad)

        def reset():
            for p in params:
                p.grad = None
            x0.grad = None
        return reset
    return _timed(once, min_time, min_reps, sync, idle_s)


class _Probe:
    """What every measurement times: a training copy of the model on `device` (the model
    itself is left as it is) and random batches of its input shape (seeded: the same
    batches every time)."""

    def __init__(self, model, sample_shape, device):
        self.dev = torch.device(device)
        self.sync = (lambda: torch.cuda.synchronize(self.dev)) if self.dev.type == "cuda" else None
        self.model = copy.deepcopy(model).to(self.dev).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.shape = tuple(sample_shape)
        self.num_classes = _num_classes(self.model, sample_shape, self.dev)
        self._g = torch.Generator().manual_seed(0)

    def data(self, rows):
        x = torch.randn((rows, *self.shape), generator=self._g).to(self.dev)
        return x, torch.randint(0, self.num_classes, (rows,), generator=self._g).to(self.dev)

    def whole(self, x, y):
        """One forward + loss + backward of the whole model, for _timed (gradients reset after)."""
        def once():
            F.cross_entropy(self.model(x), y).backward()
            return lambda: [setattr(p, "grad", None) for p in self.params]
        return once


def measure_profile(model, sample_shape, batch, make_optimizer, threads=1, device="cpu",
                    min_time=0.1, min_reps=3):
    """The Profile of `model` on inputs (batch, *sample_shape) with `threads` threads.

    Works on a copy (the model, its gradients and buffers are left as they are). Each
    item (every leaf module call, the whole model at B and at B/4, the optimizer step)
    is timed for at least `min_time` seconds and `min_reps` runs; the mean counts.
    """
    pr = _Probe(model, sample_shape, device)
    dev, sync, params = pr.dev, pr.sync, pr.params
    small = max(1, batch // 4)
    with num_threads(threads):
        x, y = pr.data(batch)
        layers = []
        calls = _leaf_calls(pr.model, x, y)
        for name, module, inp, out_shape in calls:
            seconds = _time_layer(module, inp, min_time, min_reps, sync)
            own = [p for p in module.parameters() if p.requires_grad]
            is_conv = isinstance(module, nn.Conv2d)
            layers.append(Layer(
                name=name, kind="conv" if is_conv else "linear" if isinstance(module, nn.Linear) else "other",
                seconds=seconds, params=sum(p.numel() for p in own),
                param_bytes=sum(p.numel() * p.element_size() for p in own),
                in_bytes=inp.numel() * inp.element_size(),
                out_bytes=math.prod(out_shape) * inp.element_size(),
                out_channels=module.out_channels if is_conv else 0,
                needs_input_grad=bool(inp.requires_grad),
                distributable=is_conv and why_not_distributable(module) is None))

        _time_chains(pr.model, layers, calls, min_time, min_reps, sync)
        step_s = _timed(pr.whole(x, y), min_time, min_reps, sync)
        small_s = _timed(pr.whole(*pr.data(small)), min_time, min_reps, sync)
        optimizer = make_optimizer(params)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer_s = _timed(optimizer.step, min_time, min_reps, sync)
    # Layers timed one by one add up to a little more or less than the whole model (timer
    # noise; the loss and autograd's bookkeeping belong to no layer). More: scale them down
    # to the whole, keeping their proportions; less: the remainder runs on the master.
    # The same for what conv-MP distributes (each conv with its channel-wise chain, whose
    # layers are counted among the others too): it must fit in the whole as well.
    total = max(sum(lay.seconds for lay in layers),
                sum(lay.seconds + lay.chain_s for lay in layers if lay.kind == "conv"))
    if total > step_s:
        for lay in layers:
            lay.seconds *= step_s / total
            lay.chain_s *= step_s / total
    if small < batch:   # t(b) = a + k b through (small, t_small) and (B, t_B)
        intercept = (small_s * batch - step_s * small) / (batch - small)
    else:
        intercept = 0.0
    intercept = min(max(intercept, 0.0), step_s)
    return Profile(device=dev.type, threads=int(threads), batch=int(batch), layers=layers,
                   step_s=step_s, intercept_s=intercept, optimizer_s=optimizer_s,
                   params=sum(p.numel() for p in params),
                   param_bytes=sum(p.numel() * p.element_size() for p in params),
                   kernel_block=kernel_block(dev))


def _time_chains(model, layers, calls, min_time, min_reps, sync):
    """Layer.chain_s and chain_out_bytes of each distributable conv followed by channel-wise
    layers (training.strategies.conv_mp.fuse): forward + backward of the chain on the
    conv's output, and the bytes of what it outputs; Layer.feeds: the conv it is linked to;
    Layer.head: the Linear it runs row-parallel (timed as the chain's end, its output
    what is gathered, its parameters in head_bytes)."""
    names = list(dict.fromkeys(lay.name for lay in layers if lay.distributable))
    found = fuse.plan(model, names) if names else None
    if found is None:
        return
    followers = found.followers(model)
    modules = dict(model.named_modules())
    shapes = {name: out_shape for name, _, _, out_shape in calls}
    for lay in layers:
        lay.feeds = found.links.get(lay.name, "")
        lay.head = found.heads.get(lay.name, "")
        if lay.name not in followers and not lay.head:
            continue
        chain = nn.Sequential(*followers.get(lay.name, ()))
        if lay.head:
            head = modules[lay.head]
            chain.extend([nn.Flatten(), head])
            lay.head_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
        y = torch.zeros(shapes[lay.name], device=next(model.parameters()).device, requires_grad=True)
        lay.chain_s = _time_layer(chain, y, min_time, min_reps, sync)
        with torch.no_grad():
            lay.chain_out_bytes = chain(y).numel() * y.element_size()


def measure_rows(profile, model, sample_shape, rows, min_time=0.1, min_reps=3):
    """Add t(r) for each row count r in `rows` to profile.rows_s (whole forward + loss +
    backward at exactly the rows a rank will get: the time per row is not constant, so
    the affine fit through B and B/4 can be 10% off at other counts)."""
    pr = _Probe(model, sample_shape, profile.device)
    with num_threads(profile.threads):
        for r in sorted({int(r) for r in rows if r > 0} - set(profile.rows_s)):
            profile.rows_s[r] = _timed(pr.whole(*pr.data(r)), min_time, min_reps, pr.sync, profile.idle_s)
    return profile


def measure_shares(profile, model, sample_shape, layer_split, min_time=0.1, min_reps=3):
    """Add the forward + backward seconds of every share in `layer_split` ({layer: kernels
    per rank}) to profile.shares_s: a conv of that many kernels on the layer's real input,
    as DistributedConv2d runs it (a small share is slower per kernel than the whole layer)."""
    pr = _Probe(model, sample_shape, profile.device)
    calls = {}
    for name, module, inp, _ in _leaf_calls(pr.model, *pr.data(profile.batch)):
        calls.setdefault(name, []).append((module, inp))
    with num_threads(profile.threads):
        for name, counts in layer_split.items():
            for c in sorted(set(counts)):
                key = f"{name}/{c}"
                if c <= 0 or key in profile.shares_s or name not in calls:
                    continue
                total = 0.0
                for module, inp in calls[name]:
                    part = nn.Conv2d(module.in_channels, c, module.kernel_size, module.stride, module.padding,
                                     module.dilation, bias=module.bias is not None).to(pr.dev)
                    total += _time_layer(part, inp, min_time, min_reps, pr.sync, profile.idle_s)
                profile.shares_s[key] = total
    return profile


IDLE_S = 0.02    # the pause before each run of an idle profile: about half a step of waiting


def idle_profile(profile, idle_s=IDLE_S):
    """A copy of `profile` whose rows and shares will be timed after `idle_s` of sleep each.

    A rank that sleeps while it waits (a throttled rank, in every strategy) computes with
    cold caches and a CPU the host may have given away: measured here, 11 rows of
    seed_cnn took 21.8 ms of CPU after 20 ms pauses against 17.9 ms back to back.
    measure_rows/measure_shares fill it."""
    return dataclasses.replace(profile, rows_s={}, shares_s={}, idle_s=float(idle_s))


def _num_classes(model, sample_shape, dev):
    with torch.no_grad():
        out = model(torch.zeros((1, *sample_shape), device=dev))
    return int(out.shape[1])
