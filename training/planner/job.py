"""A job's plan: measure what it needs on this machine (measure_job -> Measured), then
predict every strategy from that (plan_from): for the job's own containers, with
speed-proportional shares for the recommendation, and for simulated clusters.

On the local engine the ranks share this machine, so the profiles are timed beside
min(n, cores) − 1 co-runners training the same model (`co_runners`); the ranks' CPU
quotas and the shared cores are played out by the cost models (Scheduling).
"""
import contextlib
import dataclasses
import json
import logging
import math
import os
import select
import subprocess
import sys
import time

import torch

import conf
from training import probes
from training import strategies as registry
from training.models import build_model, check_output
from training.perf.model import Case, Layer, Link, Profile, Scheduling, link_from_rate, share_weights
from training.strategies.conv_mp.cost import conv_fraction, conv_layers_of, conv_split
from training.strategies.shares import split_rows

from .cpu import measure_strategy_cpu, measure_wait_cpu
from .link import local_load, measure_link, on_one_host
from .options import PlanOptions, check_plannable
from .profile import idle_profile, measure_profile, measure_rows, measure_shares

log = logging.getLogger(__name__)

DEFAULT_INPUT = {"digits_cnn": (1, 8, 8)}   # models whose data could not be read
FALLBACK_INPUT = (3, 32, 32)


def modelled():
    """The strategies with a cost model, in registry order."""
    return [name for name in registry.names() if registry.entry(name).cost]


def predict(name, case, config=None):
    """Strategy `name`'s predicted step for `case` (training.perf.model.Case), with its conf
    block `config` (default: its defaults); None where it cannot run (or has no cost model)."""
    cost = registry.cost_model(name)
    if cost is None:
        return None
    return cost(case, config if config is not None else conf.strategy_config(name))


def predict_all(case, configs):
    """{strategy: prediction} of every strategy with a cost model; configs: {name: conf block}."""
    return {name: predict(name, case, configs[name]) for name in modelled()}


def _input_of(spec, options):
    """((C, H, W), classes, where from) of the job's data, or the options', or a default."""
    if options.input_shape:
        return tuple(options.input_shape), options.num_classes or 10, "given"
    try:
        from training.data import open_dataset
        ds = open_dataset(spec.data, "train")
        return tuple(ds.shape), int(ds.num_classes), spec.data.train or spec.data.dataset
    except Exception as e:  # noqa: BLE001 - any unreadable dataset falls back to an assumption
        shape = DEFAULT_INPUT.get(spec.model, FALLBACK_INPUT)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        return shape, options.num_classes or 10, f"assumed (data not readable: {why})"



def _job_link(job, options):
    if options.measure_link:
        return measure_link(**local_load(job), shared=on_one_host(job))
    if options.bandwidths_bps:
        return link_from_rate(options.bandwidths_bps[0], options.latency_s)
    if job.network.bandwidth:
        return link_from_rate(job.network.bandwidth, options.latency_s or job.network.latency,
                              "the job's network.bandwidth")
    return measure_link(**local_load(job), shared=on_one_host(job))


def _job_scheduling(job, devices, options):
    """The Scheduling of the job's ranks: on the local engine they share this machine's
    cores; a polite wait's CPU is measured where there are ranks that may wait (a
    throttled one waits politely), unless given."""
    cores = (os.cpu_count() or 1) if job.backend == "local" else None
    if options.wait_cpu is not None:
        costs = tuple(options.wait_cpu)
    elif len(devices) > 1:
        costs = measure_wait_cpu()
    else:
        costs = (Scheduling.wait_s, Scheduling.wait_cpu)
    return Scheduling(cores, *costs)


def _make_optimizer_for(spec):
    from training.runner import make_optimizer_factory
    return make_optimizer_factory(spec)


def job_devices(job, profile_for, gpu_speed=None, cuda=False):
    """One Device per rank of `job`, in rank order. profile_for(threads, device) -> Profile.

    A group with GPUs is measured on CUDA where `cuda` (this machine has it); otherwise
    its device is rank 0-like CPU time divided by gpu_speed (an assumption, named in the
    device)."""
    from conf.schema import omp_threads
    from training.perf.model import Device
    devices = []
    for g in job.groups:
        k = omp_threads(g) or max(1, math.ceil(g.vcores))     # (its ranks' threads: training.context)
        if g.gpus and cuda:
            dev = Device(f"{g.name} (cuda)", profile_for(k, "cuda"), vcores=g.vcores)
        elif g.gpus and gpu_speed:
            dev = Device(f"{g.name} (gpu ~ cpu x{gpu_speed:g}, assumed)", profile_for(k, "cpu"),
                         speed=gpu_speed, vcores=g.vcores)
        elif g.gpus:
            dev = Device(f"{g.name} (gpu not measured: no CUDA here, planned as its {k} CPU "
                         f"thread{'s' if k > 1 else ''}; --gpu-speed N assumes a GPU N x that)",
                         profile_for(k, "cpu"), vcores=g.vcores, quota=min(1.0, g.vcores / k))
        else:
            dev = Device(f"{g.name} ({g.vcores:g} vcores, {k} thread{'s' if k > 1 else ''})",
                         profile_for(k, "cpu"), vcores=g.vcores, quota=min(1.0, g.vcores / k))
        devices += [dev] * g.instances
    return devices


def _rounded(d):
    if isinstance(d, float):
        return float(f"{d:.6g}")
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_rounded(v) for v in d]
    return d



@contextlib.contextmanager
def co_runners(job, shape, classes, timeout=60):
    """While the job's ranks are measured, the other ranks' work runs beside them.

    On the local engine the ranks share this machine: a rank computes while up to
    min(ranks, cores) − 1 others compute on the other cores, and shares memory bandwidth
    and caches with them (measured here: the same forward + backward 2-20% slower with a
    second one running). So the profile is timed with that many co-runners: processes
    training the job's model on B/n rows in a loop. Elsewhere (YARN) nothing is started."""
    spec = job.training
    n = sum(g.instances for g in job.groups)
    count = min(n, os.cpu_count() or 1) - 1 if job.backend == "local" else 0
    if count <= 0:
        yield []
        return
    args = json.dumps({"model": spec.model, "shape": list(shape), "classes": classes,
                       "options": dict(spec.model_options), "rows": max(1, spec.batch_size // n),
                       "parent": os.getpid()})
    procs = [subprocess.Popen([sys.executable, "-m", "training.probes.co_runner", args], env=probes.environment(),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True)        # each a session, as a rank's container is
             for _ in range(count)]
    try:
        deadline, ready = time.monotonic() + timeout, []
        for p in procs:
            if select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0] \
                    and p.stdout.readline().strip() == "READY":
                ready.append(p)
        if len(ready) < len(procs):
            log.warning("planner: %d of %d co-runners did not start; measuring without them",
                        len(procs) - len(ready), len(procs))
        yield ready
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


@dataclasses.dataclass
class Measured:
    """What plan_job measures on this machine for a job (or is given): the input, the
    model's profiles per (device, threads) and their idle copies, the link, how the
    ranks get their CPUs and what a polite wait costs, and the strategies' own CPU."""
    input_shape: tuple
    classes: int
    input_from: str
    profiles: dict                # {(device, threads): Profile}
    idle: dict                    # {(device, threads): Profile timed after idle pauses}
    link: Link
    scheduling: Scheduling
    strategy_cpu: dict            # {strategy: [rank 0's, the others']} seconds per step
    cannot_run: dict = dataclasses.field(default_factory=dict)     # {strategy: why its step failed on the model}

    def as_dict(self):
        return {"input_shape": list(self.input_shape), "classes": self.classes, "input_from": self.input_from,
                "profiles": [p.as_dict() for p in self.profiles.values()],
                "idle": [p.as_dict() for p in self.idle.values()],
                "link": dict(dataclasses.asdict(self.link)), "scheduling": dataclasses.asdict(self.scheduling),
                "strategy_cpu": self.strategy_cpu, "cannot_run": self.cannot_run}

    @classmethod
    def from_dict(cls, d):
        def profile(p):
            p = dict(p, layers=[Layer(**lay) for lay in p["layers"]],
                     rows_s={int(k): v for k, v in p["rows_s"].items()})
            return Profile(**p)
        profiles = [profile(p) for p in d["profiles"]]
        idle = [profile(p) for p in d["idle"]]
        return cls(tuple(d["input_shape"]), int(d["classes"]), d["input_from"],
                   {(p.device, p.threads): p for p in profiles}, {(p.device, p.threads): p for p in idle},
                   Link(**d["link"]), Scheduling(**d["scheduling"]), d["strategy_cpu"], d.get("cannot_run") or {})


def measure_job(job, options=PlanOptions()):
    """Measure what the plan of conf.JobSpec `job` needs on this machine (Measured)."""
    check_plannable(job)
    spec = job.training
    shape, classes, shape_from = _input_of(spec, options)
    cuda = torch.cuda.is_available()
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, shape, classes, spec.model_options)
    # logits of (batch, classes), as the runner checks (a model returning a tuple was a traceback here);
    # their number only where the data or --num-classes gave the classes
    known = options.num_classes or not (shape_from == "given" or shape_from.startswith("assumed"))
    check_output(model, spec.model, torch.zeros((2, *shape)), classes if known else None)
    make_opt = _make_optimizer_for(spec)
    profiles = {}

    def profile_for(threads, device):
        key = (device, threads)
        if key not in profiles:
            profiles[key] = measure_profile(model, shape, spec.batch_size, make_opt, threads, device,
                                            min_time=options.min_time, min_reps=3)
        return profiles[key]

    link = _job_link(job, options)
    B = spec.batch_size
    with co_runners(job, shape, classes):
        devices = job_devices(job, profile_for, options.gpu_speed, cuda)
        ref = devices[0]
        conv = conf.strategy_config("conv_model_parallel", job)
        names = conv_layers_of(ref.profile, conv.layers)
        # Time what the ranks will really run: their row counts and their kernel shares.
        rows = set()
        for shares in (spec.shares, "speed"):
            rows.update(split_rows(B, share_weights(devices, shares)))
        layer_split = conv_split(devices, names, conv.split) if names else None
        idle = {}
        for key, prof in profiles.items():
            measure_rows(prof, model, shape, rows, min_time=options.min_time)
            if layer_split:
                measure_shares(prof, model, shape, layer_split, min_time=options.min_time)
            users = [d for d in devices if d.profile is prof]
            if any(d.quota < 1.0 for d in users):
                idle[key] = cold = idle_profile(prof)
                measure_rows(cold, model, shape, rows, min_time=options.min_time)
                if layer_split:
                    measure_shares(cold, model, shape, layer_split, min_time=options.min_time)
    sched = _job_scheduling(job, devices, options)
    own, cannot = options.strategy_cpu, {}
    if own is None and len(devices) > 1:
        own, cannot = measure_strategy_cpu(spec.model, spec.model_options, shape, classes, B, names,
                                           steps=options.strategy_steps, with_failures=True)
    return Measured(shape, classes, shape_from, profiles, idle, link, sched, own or {}, cannot)


def plan_job(job, options=PlanOptions()):
    """The plan of a conf.JobSpec with a training section: a JSON-ready dict with the
    measured profiles and link, the prediction of every strategy for the job's own
    containers, the recommendation, and the simulated clusters."""
    return plan_from(job, measure_job(job, options), options)


def plan_from(job, measured, options=PlanOptions()):
    """The plan of `job` from what was measured for it (Measured): no measurement here.

    Every strategy with a cost model is predicted for the job's containers with its
    configuration for the job (the job's own strategy block, else the defaults), and the
    data-parallel ones (those `training.shares` splits) also with shares 'speed'; the
    fastest is recommended. The simulated clusters use every strategy's defaults."""
    spec = job.training
    shape, classes = measured.input_shape, measured.classes
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, shape, classes, spec.model_options)
    profiles, link, sched, own = measured.profiles, measured.link, measured.scheduling, measured.strategy_cpu
    B = spec.batch_size
    cuda = any(device == "cuda" for device, _ in profiles)
    devices = job_devices(job, lambda threads, device: profiles[(device, threads)], options.gpu_speed, cuda)
    ref = devices[0]     # rank 0's device as timed back to back: single_s, f, the simulated machines
    devices = [dataclasses.replace(d, idle=measured.idle.get((d.profile.device, d.profile.threads)))
               for d in devices]
    configs = {name: conf.strategy_config(name, job) for name in modelled()}
    names = conv_layers_of(ref.profile, configs["conv_model_parallel"].layers)
    case = Case(devices, link, B, spec.shares, sched, tuple(names), own or {})
    preds = predict_all(case, configs)
    # The data-parallel strategies also with speed-proportional shares, for the recommendation.
    speed = dataclasses.replace(case, shares="speed")
    speed_preds = {name: predict(name, speed, configs[name]) for name in modelled() if registry.entry(name).data_parallel}
    for name in measured.cannot_run:        # its step raised on this model (the strategy probe)
        preds[name] = None
        speed_preds.pop(name, None)
    mine = spec.strategy.name
    if len(devices) == 1:   # nothing to spread: the predictions differ by their models' error only
        best = mine if preds.get(mine) else "allreduce"
        best_p = preds[best]
        why = "one rank: every strategy runs the whole model on it; " + (
            "the job's own is kept" if best == mine else f"{mine} has no step-time model, allreduce runs the "
                                                        f"model as it is")
    else:
        candidates = [(p["step_s"], k, p, "the job's shares") for k, p in preds.items() if p]
        candidates += [(p["step_s"], k, p, "shares: speed") for k, p in speed_preds.items()]
        _, best, best_p, how = min(candidates, key=lambda c: c[0])
        if registry.entry(best).data_parallel:
            why = f"rows per rank {best_p['split']} ({how})"
        else:
            why = f"kernels per rank {best_p['split']}"
    f = conv_fraction(ref, names, configs["conv_model_parallel"].fuse) if names else 0.0
    conv = preds["conv_model_parallel"]
    plan = {
        "job": job.name,
        "model": {"name": spec.model, "options": dict(spec.model_options), "input_shape": list(shape),
                  "input_from": measured.input_from, "classes": classes, "batch": B,
                  "params": ref.profile.params, "param_bytes": ref.profile.param_bytes,
                  "conv_layers": names, "conv_fraction": f},
        "link": link.as_dict(),
        "scheduling": dict(dataclasses.asdict(sched), strategy_cpu=own),
        "devices": [{"rank": r, "name": d.name, "speed": d.speed, "quota": d.quota, "vcores": d.vcores,
                     "threads": d.profile.threads, "device": d.profile.device,
                     "step_s": d.step_s} for r, d in enumerate(devices)],
        "profiles": [p.as_dict() for p in profiles.values()],
        "shares": spec.shares,
        "single_s": ref.step_s,
        "strategies": preds,
        "speed_shares": speed_preds,
        # one_container: every strategy is predicted slower than one container like rank 0's,
        # which is then the recommendation (strategy: the fastest spread, for reference)
        "recommended": {"strategy": best, "step_s": best_p["step_s"], "speedup": best_p["speedup"],
                        "split": best_p["split"], "why": why,
                        "one_container": len(devices) > 1 and best_p["speedup"] < 1},
        "job_strategy": spec.strategy.name,
        "cannot_run": dict(measured.cannot_run),
        "bound": conv["bound"] if conv else None,
        "scaling": [dict(row, strategies={k: None if k in measured.cannot_run else v
                                          for k, v in row["strategies"].items()})
                    for row in simulate(ref, link.between_machines(), B, names, options, own)],
        "volumes": _volumes(model, shape, [d.speed for d in devices], B),
    }
    return _rounded(plan)


def _volumes(model, shape, capacities, batch):
    """Communication volume and balance per method (training.partition; Eserol 2019):
    hypergraph partition, conv-layer split, pipeline, data parallelism. None (with the
    reason) for a model the partitioner cannot take, or a single rank."""
    if len(capacities) < 2:
        return {"note": "one rank: nothing to partition"}
    from training.partition import PartitionError, partition_report
    try:
        return {"rows": partition_report(model, shape, capacities, batch)}
    except PartitionError as e:
        return {"note": f"no volume report: {e}"}


def simulate(ref, link, batch, names, options, own=None):
    """Predictions for clusters of m machines like `ref` (speed 1) for every m in
    options.machines and every bandwidth (options.bandwidths_bps, else the job's link),
    and, with options.gpu_speed, for one GPU (ref × gpu_speed, the master) plus m−1 CPUs
    (data-parallel shares and kernels proportional to speed; every strategy's defaults)."""
    configs = {name: conf.strategy_config(name) for name in modelled()}
    rates = options.bandwidths_bps or (link.bandwidth_bps,)
    latency = options.latency_s if options.latency_s is not None else link.latency_s
    kinds = [("cpu", None)] + ([("gpu+cpu", options.gpu_speed)] if options.gpu_speed else [])
    out = []
    for kind, gpu in kinds:
        for bps in rates:
            lk = Link(latency, bps / 8.0, link.source if bps == link.bandwidth_bps else "given")
            for m in options.machines:
                devs = [ref] * m
                if gpu:
                    devs = [dataclasses.replace(ref, name=f"gpu (x{gpu:g})", speed=ref.speed * gpu)] + [ref] * (m - 1)
                preds = predict_all(Case(devs, lk, batch, "speed", Scheduling(), tuple(names), own or {}), configs)
                out.append({"cluster": kind, "machines": m, "bandwidth_bps": bps,
                            "strategies": {k: (None if p is None else {"step_s": p["step_s"], "speedup": p["speedup"]})
                                           for k, p in preds.items()},
                            "bound": preds["conv_model_parallel"]["bound"] if preds["conv_model_parallel"] else None})
    return out
