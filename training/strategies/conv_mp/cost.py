"""The cost model of conv-layer model parallelism (seed 1: Marques et al. 2018), and the
bound on its speedup.

Rank 0 is the master; distributed convs l with C_l kernels split c_r,l, by default in
proportion to the speed 1/t_r,l (training.strategies.conv_mp.calibrate.proportional_split);
t_0(B) the master's forward + backward of the whole batch, t_r,l rank r's time of layer l
(with `fuse`, of the conv and its channel-wise chain, and of the Linear it runs
row-parallel where it has one), |Y_l| its output's bytes (with `fuse`, the chain's
output; with a row-parallel Linear, the Linear's: the partial outputs gathered, dZ
broadcast), o_0 the master's optimizer step, α + m/β the link's one-way
time of m bytes:

    T = (t_0(B) − Σ_l t_0,l) + Σ_l [max_r (c_r,l/C_l) t_r,l + comm_l]
        + o_0 (1 − Σ_l (|W_l|/|W|)(1 − c_0,l/C_l)) + (2L + 2)⌈log2 n⌉α
    comm_l = bcast(|X_l|) + 2(1 − c_0,l/C_l)|Y_l|/β + 5⌈log2 n⌉α
             [+ reduce(|X_l|) where an earlier layer needs dX]
    a link l → l+1 (l's output goes to l+1 alone, fuse's `links`): l's Y all-gathered and
    dY exchanged rank to rank, 2 max_r(1 − c_r,l/C_l)|Y_l|/β + 4⌈log2 n⌉α, and no
    bcast(|X_l+1|) or reduce(|X_l+1|)
    bcast(v) = reduce(v) = min(⌈log2 n⌉(α + v/β), 2(n−1)/n·v/β + (⌈log2 n⌉ + n − 1)α)
             (binomial tree, or scatter + all-gather, whichever MPI would pick)

played out under the ranks' CPU quotas and shared cores (training.perf.quota_sim: a
phase per conv layer, the rest of the network, the optimizer; the workers wait
politely, and copy what they receive inside their waits). The shares' times are the
measured times of convs of that many kernels (a small share is slower per kernel).

With `recalibrate_every`, the split is the one recalibration settles on (`_settled`,
the strategy's own rules played on these times): a rank its CPU quota holds back is
charged its whole step's CPU for its shares, so it keeps fewer kernels than its speed
alone gives it.

    the bound   S ≤ 1 / ((1 − f) + f/k)  (seed 1), f = Σ_l t_0,l / (t_0(B) + o_0) the
                distributed convs' share of one device's step; k = Σ_r s_r / s_0 with
                s_r = 1/t_r(B) (k = n for equal devices)
"""
import collections

from training.perf.formulas import amdahl_bound, log2, proportional_s
from training.perf.model import PlanError, per_rank, prediction

from .calibrate import corrected_speeds, proportional_split, worth_resharding


def _bcast_s(nbytes, n, link):
    """MPI broadcast (or reduce) of nbytes over n ranks: tree or scatter + all-gather."""
    if n <= 1:
        return 0.0
    a, b, lg = link.latency_s, link.bandwidth_Bps, log2(n)
    return min(lg * (a + nbytes / b), 2 * (n - 1) / n * nbytes / b + (lg + n - 1) * a)


def conv_layers_of(profile, names=None):
    """The distributed convs: `names` (the strategy's `layers`) or every distributable one."""
    convs = [lay for lay in profile.layers if lay.kind == "conv"]
    if names is not None:
        known = {lay.name for lay in convs}
        unknown = [x for x in names if x not in known]
        if unknown:
            raise PlanError(f"training.strategy.layers: {unknown} are not Conv2d layers of the "
                            f"model; its Conv2d layers are {sorted(known)}")
        return list(dict.fromkeys(x for x in (lay.name for lay in convs) if x in set(names)))
    return list(dict.fromkeys(lay.name for lay in convs if lay.distributable))


def distributed_s(device, name, fuse=True):
    """One device's seconds of what conv-MP distributes of layer `name`: the conv, and
    with `fuse` its channel-wise chain."""
    return device.layer_s(name) + (device.chain_s(name) if fuse else 0.0)


def conv_fraction(device, names, fuse=True):
    """f: the distributed part's share of one device's whole step (seed 1's bound): the
    convs and, with `fuse`, their channel-wise chains. At most 1: layers timed one by one
    can add up past the step timed back to back (the seed network at 128/384 on one
    rank: 1.02), and a share of more than the whole would bound the speedup above k."""
    return min(1.0, sum(distributed_s(device, x, fuse) for x in names) / device.step_s)


def conv_split(devices, names, split):
    """{layer: kernels per rank}: `split` weights, else in proportion to the devices' speed on
    each layer, in whole vector blocks as the strategy splits; None where a layer has fewer
    kernels than there are ranks."""
    out = {}
    block = max(d.profile.kernel_block for d in devices)
    for name in names:
        kernels = devices[0].profile.layer(name)[0].out_channels
        weights = split if split is not None else [1.0 / d.layer_s(name) for d in devices]
        try:
            out[name] = proportional_split(kernels, weights, block)
        except ValueError:
            return None
    return out


def _out_bytes(call, fuse):
    """|Y| gathered of one call: the chain's output where the chain runs in the shards."""
    return call.chain_out_bytes if fuse and call.chain_out_bytes else call.out_bytes


def links_of(profile, names, fuse=True):
    """{a: b}: distributed convs whose output goes to the next distributed conv alone
    (Layer.feeds, found by training.strategies.conv_mp.fuse); none without `fuse`."""
    if not fuse:
        return {}
    return {lay.name: lay.feeds for lay in profile.layers
            if lay.name in names and lay.feeds and lay.feeds in names}


def _received(counts):
    """Each rank's share of a layer's output it does not compute itself, the largest."""
    return max(1.0 - c / sum(counts) for c in counts)


def _conv_times(devices, link, names, layer_split, fuse):
    """(rest on the master, [(each rank's full-speed share, comm) per layer], the
    communication in all, the fraction of the master's optimizer step it still runs)."""
    n, master = len(devices), devices[0]
    prof = master.profile
    lg, a, b = log2(n), link.latency_s, link.bandwidth_Bps
    rest = max(0.0, master.fwd_bwd_s(prof.batch) - sum(distributed_s(master, x, fuse) for x in names))
    links = links_of(prof, names, fuse)
    fed = set(links.values())
    layers, comm, moved = [], 0.0, 0.0
    for name in names:
        calls, counts = prof.layer(name), layer_split[name]
        kernels = sum(counts)
        shares = [d.share_s(name, c, full=True, chain=fuse) for c, d in zip(counts, devices)]
        away = 1.0 - counts[0] / kernels
        moved += (calls[0].param_bytes + calls[0].head_bytes) * away
        layer_comm = 0.0
        if n > 1:
            for call in calls:
                if name not in fed:     # X broadcast from the master, dX reduced there
                    layer_comm += _bcast_s(call.in_bytes, n, link) * (1 + call.needs_input_grad)
                if name in links:       # Y all-gathered, dY exchanged rank to rank
                    layer_comm += 2 * _received(counts) * _out_bytes(call, fuse) / b + 4 * lg * a
                else:                   # Y gathered at the master, dY scattered from it
                    layer_comm += 2 * away * _out_bytes(call, fuse) / b + 5 * lg * a
        layers.append((shares, layer_comm))
        comm += layer_comm
    if n > 1:
        comm += (2 * len(names) + 2) * lg * a
    return rest, layers, comm, 1.0 - moved / prof.param_bytes


Played = collections.namedtuple("Played", "step phases waits layers rest comm opt_part")
Played.__doc__ = """A split's step played under the ranks' quotas: its seconds, the phases and
waits quota_sim played, each layer's (full-speed shares per rank, exchange seconds), the
rest of the network on the master, the communication, the master's part of the optimizer."""


def _play(case, names, layer_split, own, fuse):
    """The step of `layer_split` played under the ranks' quotas (Played)."""
    devices, link, sched = case.devices, case.link, case.sched
    n, master = len(devices), devices[0]
    rest, layers, comm, opt_part = _conv_times(devices, link, names, layer_split, fuse)
    protocol = (2 * len(names) + 2) * log2(n) * link.latency_s if n > 1 else 0.0
    idle = [0.0] * (n - 1)
    calls = [len(master.profile.layer(x)) for x in names]
    mine = per_rank(own, n)
    # a worker copies what it receives and sends inside its waits: X, its share
    # of Y and of dY, and dX where it is needed; over a link, the others' share of Y
    # and of dY instead of X and dX
    links = links_of(master.profile, names, fuse)
    fed = set(links.values())

    def worker_bytes(x, call, c):
        own = c / sum(layer_split[x])
        moved = 0.0 if x in fed else call.in_bytes * (1 + call.needs_input_grad)
        return moved + 2 * (1 - own if x in links else own) * _out_bytes(call, fuse)
    copied = [[sum(worker_bytes(x, call, c) for call in master.profile.layer(x)) * sched.byte_s if r else 0.0
               for r, c in enumerate(layer_split[x])] for x in names]
    charged = [([t + o * c / sum(calls) + b for t, o, b in zip(shares, mine, copy_l)], comm_l)
               for (shares, comm_l), c, copy_l in zip(layers, calls, copied)]
    # each layer's shares (and the workers' protocol) and its exchanges; the rest of the
    # network on the master (at full speed: rest is at its quota already); the master's
    # optimizer and the step's protocol
    phases = [shares for shares, _ in charged] + [[rest * master.quota] + idle,
                                                  [master.optimizer_s(opt_part, full=True)] + idle]
    # a worker's waits: per call of a layer, the command, X's broadcast and the gather in
    # forward, the command and the scatter in backward (and dX's reduce where needed);
    # the step's end and the gather of conv times
    waits = [sum(5 + call.needs_input_grad - (x in fed) * (1 + call.needs_input_grad) - (x in links)
                 for call in master.profile.layer(x)) for x in names] + [0, 2]
    step = sched.step_s(devices, phases, [c for _, c in charged] + [0.0, protocol], waits)
    return Played(step, phases, waits, layers, rest, comm, opt_part)


RECALIBRATIONS = 20     # recalibrations played out at most (a job makes one every recalibrate_every steps)
SETTLED = 0.005         # ... until no rank's corrected speed moves by more than this


def _settled(case, names, layer_split, played, play):
    """The split recalibration settles on (training.strategy's recalibrate_every), played
    with the strategy's own rules (ConvModelParallelStrategy.recalibrate): each rank's
    seconds per layer, corrected speeds (calibrate.corrected_speeds), a new proportional
    split where it pays (worth_resharding). A rank with a core of its own reports its
    shares' full-speed time; one that its quota holds back (under a quota and busy for
    BUSY_QUOTA of it) each share's part of its whole step's CPU over its vcores (its
    protocol, copies and polite waits included: _share_seconds), so it settles on fewer
    kernels than its speed alone would give it."""
    from .strategy import BUSY_QUOTA
    devices, sched = case.devices, case.sched
    block = max(d.profile.kernel_block for d in devices)
    kernels = {x: sum(layer_split[x]) for x in names}
    speeds = {x: [kernels[x] / d.layer_s(x) for d in devices] for x in names}
    for _ in range(RECALIBRATIONS):
        step, phases, waits = played.step, played.phases, played.waits
        seconds = {x: list(shares) for x, (shares, _) in zip(names, played.layers)}
        for r, d in enumerate(devices):
            if d.quota >= 1.0 or d.profile.device != "cpu":        # charged so on CPU ranks only
                continue
            compute = sum(p[r] for p in phases) + sum(waits) * sched.wait_s
            cpu = min(d.quota * step, compute + sched.wait_cpu * max(0.0, step - compute / d.quota))
            shares = sum(seconds[x][r] for x in names)
            if cpu >= BUSY_QUOTA * d.quota * step and shares > 0:
                for x in names:
                    seconds[x][r] *= max(1.0, cpu / shares) / d.quota
        before, speeds = speeds, corrected_speeds(speeds, layer_split, seconds, block)
        new = {}
        for x in names:
            split = proportional_split(kernels[x], speeds[x], block)
            new[x] = split if worth_resharding(layer_split[x], split, speeds[x], block=block) else layer_split[x]
        if new != layer_split:
            layer_split, played = new, play(new)
        elif all(abs(a / b - 1.0) < SETTLED for x in names for a, b in zip(speeds[x], before[x])):
            break           # the speeds too: no later recalibration moves a kernel
    return layer_split, played


def predict(case, config):
    """Conv-layer model parallelism over case.conv_layers, rank 0 the master (module
    docstring), played out under the ranks' quotas (quota_sim; throttled ranks wait politely).

    config.split: kernel weights, one per rank, else each layer's kernels in proportion
    to the devices' speed on it, and with config.recalibrate_every where recalibration
    settles (_settled: it moves kernels off quota-bound ranks). The strategy's own CPU
    (case.own_cpu): the master's protocol CPU per step and a worker's CPU per step besides
    its shares and waits, spread over the layers by their calls. None where there is no conv layer to
    distribute, or a layer has fewer kernels than there are ranks (it cannot be split).
    """
    devices, names = case.devices, list(case.conv_layers)
    if not names:
        return None
    own = case.own_cpu("conv_model_parallel")
    layer_split = conv_split(devices, names, config.split)
    if layer_split is None:
        return None
    master = devices[0]
    B = master.profile.batch
    fuse = config.fuse

    def play(split):
        return _play(case, names, split, own, fuse)
    played, start = play(layer_split), layer_split
    if config.split is None and getattr(config, "recalibrate_every", 0) and any(d.quota < 1.0 for d in devices):
        layer_split, played = _settled(case, names, layer_split, played, play)
    step, phases, rest, comm, opt_part = played.step, played.phases, played.rest, played.comm, played.opt_part
    conv_s = sum(max(d.share_s(x, c, chain=fuse) for c, d in zip(layer_split[x], devices))
                 for x in names)
    speeds = [1.0 / d.fwd_bwd_s(B) for d in devices]
    f = conv_fraction(master, names, fuse)
    k = sum(speeds) / speeds[0]
    ideal = sum(proportional_s([distributed_s(d, x, fuse) for d in devices]) for x in names)
    formula = rest + conv_s + comm + master.optimizer_s(opt_part)
    rank_s = [sum(p[r] for p in phases) / d.quota for r, d in enumerate(devices)]   # each one's compute
    return prediction("conv_model_parallel", devices, step, step - comm, comm, layer_split,
                       rank_s=rank_s, formula_s=formula, conv_s=conv_s, conv_ideal_s=ideal, rest_s=rest,
                       conv_fraction=f, effective_devices=k, bound=amdahl_bound(f, k),
                       **({"settled_from": start} if layer_split != start else {}))
