"""The CPU the ranks spend beyond the model: what a polite wait costs, and what each
strategy spends per step on its own (both measured on two joined ranks: training.probes)."""
import statistics

import re

from training import probes, strategies as registry
from training.perf.model import PlanError

from .link import run_probe


def _slope(points):
    """The least-squares slope through (x, y) points."""
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-18)


def measure_wait_cpu(late=(0.002, 0.005, 0.02), repeat=10, timeout=60, sizes=(8, 256 << 10, 1 << 20),
                     bcasts=20):
    """(a, r, b): what a polite wait (training.collectives.wait, as throttled ranks
    wait, woken by doorbells as on one host) costs in CPU: a seconds for every wait (its
    0.2 ms spin, the first wake-ups) plus r seconds per second it lasts (a wake-up after
    BELL_TIMEOUT_S, doubling to MAX_BELL_TIMEOUT_S, to test; every ~0.2 ms without
    doorbells) plus b seconds per byte it
    receives (MPI copies the message inside the wait).
    Two joined ranks, one computing `late` seconds before it sends 8 bytes, the other
    waiting and counting its own CPU seconds; a line fitted through the median of each
    `late` (a stall of the machine in one wait does not tilt it) gives a and r. Then
    broadcasts of each of `sizes` bytes after 5 ms (the strategies move data in
    collectives), interleaved, `bcasts` of each, from buffers not in the cache (a step's
    activations are not): b is the slope, over the sizes, of the median CPU beyond r·wait.
    Measured here: a ~0.25 ms, r ~0.012 (0.02 waking every 2 ms, ~0.1 without doorbells),
    b 0.1-0.25 ns (0.1-0.25 ms per MB)."""
    out = run_probe("training.probes.wait_cpu", {"late": list(late) * repeat, "sizes": list(sizes),
                                                 "bcasts": int(bcasts)}, "wait probe", timeout, advice="")
    sent = {int(k[1:]): out.pop(k) for k in list(out) if k.startswith("b")}
    points = [(statistics.median(w for _, w in xs), statistics.median(c for c, _ in xs)) for xs in out.values()]
    r = min(max(_slope(points), 0.0), 1.0)
    a = statistics.fmean(c for _, c in points) - r * statistics.fmean(w for w, _ in points)
    b = _slope([(n, statistics.median(c - r * w for c, w in xs)) for n, xs in sent.items()])
    return max(0.0, a), r, max(0.0, b)



def measure_strategy_cpu(model_name, options, sample_shape, classes, batch, layers, strategies=None,
                         steps=20, timeout=180, with_failures=False):
    """{strategy: [rank 0's, a worker's]} seconds of CPU a rank spends per step beyond
    what the planner times and counts itself: the model's forward + backward on its rows
    (the profile), conv shares, the optimizer, the waits (measure_wait_cpu). That is the
    strategy's own work: gradient hooks and bucket copies, packing a flat gradient,
    summing the server's gradients, the conv-MP protocol's Python and autograd, the MPI
    calls. Every strategy (`strategies`, default: those with a cost model) runs for real
    on two joined ranks (training.probes.strategy_cpu: batch split equally, the
    second rank waiting politely as a throttled one does, one thread each); per step its
    CPU time minus what it spent in the model's forward + backward (less the gradient
    hooks run inside it), its conv shares, the optimizer and its waits; for the conv-MP
    master (whose step also runs the rest of the network, which the profile has), the
    CPU of its protocol alone: the distributed layers' forward, the backward of their
    broadcast and gather, its commands to the workers, less its shares and waits inside
    them (each strategy counts its work in training.cputime and says which part is its
    own: Strategy.own_cpu_s). The median over `steps` steps; CPU time throughout: a busy machine slows the
    probe but does not change what it counts. Here, seed_cnn: ~0.5-1 ms for the
    data-parallel strategies, ~3 ms for a conv-MP worker; on a 0.5-vcore rank that
    comes out of its quota. A strategy that cannot run the model (its step raises) is left
    out; with_failures: ({strategy: seconds}, {strategy: its error line})."""
    if strategies is None:
        strategies = [k for k in registry.names() if registry.entry(k).cost]
    strategies = [k for k in strategies if k != "conv_model_parallel" or layers]
    args = {"model": model_name, "options": dict(options), "shape": list(sample_shape), "classes": int(classes),
            "batch": int(batch), "layers": list(layers or []), "steps": int(steps), "strategies": strategies,
            "warmup": 3 if steps >= 10 else 1}
    cannot = {}
    while True:
        try:
            out = probes.run("training.probes.strategy_cpu", 2, args, timeout=timeout)
            break
        except probes.ProbeError as e:
            said = re.search(rf"^{probes.FAILED}(\S+): (.*)$", getattr(e, "output", ""), re.M)   # rank 0's first
            if not said or said.group(1) not in args["strategies"]:
                raise PlanError(f"the MPI strategy probe failed ({e})") from None
            cannot[said.group(1)] = said.group(2)       # the others are measured without it
            args["strategies"] = [k for k in args["strategies"] if k != said.group(1)]
            if not args["strategies"]:
                raise PlanError("no strategy could run the model in the strategy probe: " + "; ".join(
                    f"{k}: {v}" for k, v in cannot.items())) from None
    own = {k: [max(0.0, float(v)) for v in vs] for k, vs in out.items()}
    return (own, cannot) if with_failures else own
