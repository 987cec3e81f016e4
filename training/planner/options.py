"""How to plan: PlanOptions, parsing them from `yarnapp plan`'s command line, and what a
job needs to be planned at all (checked before anything is measured or imported)."""
import dataclasses
import math

from training.perf.model import PlanError

QUICK_MIN_TIME = 0.02              # --quick: seconds each timed item runs (default 0.1)
QUICK_STRATEGY_STEPS = 5           # --quick: steps each strategy's own CPU is the median of (default 20)


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How to plan. The job's link is measured (MPI ping-pong) with measure_link, else the
    first of `bandwidths_bps` (with latency_s, default DEFAULT_LATENCY_S), else the job's
    network.bandwidth, else measured; the simulated clusters use every bandwidth given."""
    measure_link: bool = False
    bandwidths_bps: tuple = ()        # simulated clusters (and the job unless measured)
    latency_s: float = None
    machines: tuple = (1, 2, 4, 8, 16)
    gpu_speed: float = None           # simulated GPU = rank 0's device × this speed
    min_time: float = 0.1             # seconds each timed item runs (at least 3 runs)
    input_shape: tuple = None         # (C, H, W) when the job's data cannot be read
    num_classes: int = None
    wait_cpu: tuple = None            # (a, r[, b]) of a polite wait (default: measure_wait_cpu)
    strategy_cpu: dict = None         # the strategies' own CPU per step (default: measure_strategy_cpu)
    strategy_steps: int = 20          # measure_strategy_cpu's steps per strategy


MAX_MACHINES = 512


def parse_options(measure=False, bandwidth=None, latency=None, machines=None, gpu_speed=None,
                  quick=False, input_shape=None, classes=None):
    """PlanOptions from command-line strings: bandwidth '1gbit[,10gbit]', latency '0.05ms',
    machines '1,2,4', input_shape '1x8x8'."""
    from conf.units import parse_duration_s, parse_rate_bps

    def items(text):
        return [s.strip() for s in str(text).split(",") if s.strip()]
    def each(flag, parse, text):
        try:
            return parse(text)
        except ValueError as e:
            raise PlanError(f"{flag}: {e}") from None
    bws = tuple(each("--bandwidth", parse_rate_bps, b) for b in items(bandwidth)) if bandwidth else ()
    lat = each("--latency", parse_duration_s, latency) if latency else None
    try:
        mach = tuple(int(m) for m in str(machines).split(",")) if machines else PlanOptions.machines
    except ValueError:
        mach = ()
    if any(m < 1 for m in mach) or not mach:
        raise PlanError(f"--machines: expected positive integers such as 1,2,4,8,16, got {machines!r}")
    if max(mach) > MAX_MACHINES:        # (1000 throttled ranks: minutes in quota_sim, which grows as their square)
        raise PlanError(f"--machines: at most {MAX_MACHINES} machines are simulated, got {max(mach)}")
    try:
        shape = tuple(int(s) for s in str(input_shape).lower().split("x")) if input_shape else None
    except ValueError:
        shape = ()
    if shape is not None and (len(shape) != 3 or min(shape) < 1):
        raise PlanError(f"--input-shape: expected CxHxW such as 3x32x32, got {input_shape!r}")
    if classes is not None and classes < 1:
        raise PlanError(f"--classes: must be at least 1, got {classes}")
    if gpu_speed is not None and not (math.isfinite(gpu_speed) and gpu_speed > 0):
        raise PlanError(f"--gpu-speed: must be a finite number > 0, got {gpu_speed}")
    return PlanOptions(measure_link=bool(measure), bandwidths_bps=bws, latency_s=lat, machines=mach,
                       gpu_speed=gpu_speed, min_time=QUICK_MIN_TIME if quick else PlanOptions.min_time,
                       strategy_steps=QUICK_STRATEGY_STEPS if quick else PlanOptions.strategy_steps,
                       input_shape=shape, num_classes=classes)


def check_plannable(job):
    """Raise PlanError unless conf.JobSpec `job` runs the built-in runner's training."""
    if job.training is None:
        raise PlanError("training: the job has none, and the planner predicts the built-in runner's strategies for "
                        "it; add a training section (docs/job-reference.md)")
