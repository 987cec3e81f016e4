"""The planner's predicted step time against the real strategies, on the configurations
it was tuned on and on held-out ones.

    python benchmarks/planner_check.py --reserve --repeat 3   # the note's run: every configuration
    python benchmarks/planner_check.py --quick                # ~1.5 s of steps per run
    python benchmarks/planner_check.py --configs tuned        # only the 8 tuned cases (or held-out)
    python benchmarks/planner_check.py --configs resnet,batch64 --strategies allreduce,ps_central

Configurations (`CONFIGS`): the planner was tuned on two, seed_cnn conv 32/96 at batch 32
on 3x32x32, shares 'vcores', kernels split by the same weights, with a group of 1 vcore
and (n−1) ranks of 0.5 vcore for n = 2 and 3 ("tuned-2", "tuned-3": 4 strategies each, the
8 tuned cases). The held-out ones change one thing each, and were not fitted on: another
model (ResNet, "resnet"), another batch ("batch64"), other vcore mixes (two 1-vcore ranks
"vcores-1-1"; two 0.5-vcore ranks, the master throttled too, "vcores-05-05"; 1 + 1 + 0.5
vcores on 3 ranks, "vcores-1-1-05"); they have been run after planner changes since
2026-11-24, so they are no longer unseen. The "fresh" ones (another width and batch,
"fresh-seed-64"; a 3-stage ResNet on 3 ranks, "fresh-resnet-3"; the digits CNN on 8x8,
"fresh-digits") were added on 2026-11-30 and had not been run before their first
recorded run (`--configs fresh`).

For every configuration the planner (training.planner, the code behind `yarnapp plan`)
measures the link with its ping-pong of two joined ranks, what a polite wait costs and
the strategies' own CPU (its probes), and, right before each run (so that both see the
machine as loaded as it is then), the model layer by layer in this process, and
predicts the strategy's step time. Then the strategy runs for real: n processes joined
into one world as the engine's containers join (launcher.world.run_local: MPI
singletons, Connect/Accept), every rank in its own cgroup with the CPU quota of its
vcores as the local engine sets it (100 ms CFS period; see make_cgroups for why not
under the engine's parent), ceil(vcores) torch threads, polite waits where throttled
(as training.runner sets them), a RunContext.offline of the job, the strategy from the
registry, 16 random batches cycled (common.random_batches); measured step time = wall time of the timed steps
between two barriers / their number, after warm-up steps. The timed steps last about
`--seconds` by the prediction (at least 5 steps): a 0.5-vcore rank runs 50 ms of every
100 ms CFS period, so a run of a few steps would measure where the periods happened to
fall. Each rank's CPU in waits and conv shares is read from training.cputime.

Prints predicted, measured and error % per case (target: within 15%), the tuned and the
held-out cases apart with the accuracy of each group, and writes
benchmarks/results/planner_check.json. Needs root and cgroup v1 for the quotas; without
them every rank runs unthrottled and the error says little.
"""
import argparse
import copy
import itertools
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import common  # noqa: E402  (machine description, JSON writer)

CGROUP_CPU = "/sys/fs/cgroup/cpu"
RESERVE_SHARES = 8192
STRATEGIES = ("allreduce", "ps_central", "ps_sharded", "conv_model_parallel")
TARGET = 0.15


SEED = {"model": "seed_cnn", "options": {"conv1": 32, "conv2": 96}, "batch": 32, "input_shape": [3, 32, 32]}
CONFIGS = {   # name: (group, what the run uses); "tuned" ones are those the planner was tuned on
    "tuned-2": ("tuned", dict(SEED, vcores=[1.0, 0.5])),
    "tuned-3": ("tuned", dict(SEED, vcores=[1.0, 0.5, 0.5])),
    "resnet": ("held-out", {"model": "resnet", "options": {"width": 8, "blocks": 1, "stages": 2}, "batch": 32,
                            "input_shape": [3, 32, 32], "vcores": [1.0, 0.5]}),
    "batch64": ("held-out", dict(SEED, batch=64, vcores=[1.0, 0.5])),
    "vcores-1-1": ("held-out", dict(SEED, vcores=[1.0, 1.0])),
    "vcores-05-05": ("held-out", dict(SEED, vcores=[0.5, 0.5])),
    "vcores-1-1-05": ("held-out", dict(SEED, vcores=[1.0, 1.0, 0.5])),
    # added 2026-11-30 and never run before their first recorded run (the five above have been
    # run after planner changes since 2026-11-24: seen, if never fitted on)
    "fresh-seed-64": ("fresh", dict(SEED, options={"conv1": 64, "conv2": 192}, batch=16, vcores=[1.0, 0.5])),
    "fresh-resnet-3": ("fresh", {"model": "resnet", "options": {"width": 16, "blocks": 1, "stages": 3},
                                 "batch": 16, "input_shape": [3, 32, 32], "vcores": [1.0, 0.5, 0.5]}),
    "fresh-digits": ("fresh", {"model": "digits_cnn", "options": {}, "batch": 48, "input_shape": [1, 8, 8],
                               "vcores": [1.0, 0.5]}),
}


def job_dict(size, strategy="allreduce"):
    """The job of one configuration: a group per run of equal vcores (r0, r1, ...), shares
    'vcores', and for conv-layer model parallelism kernels split by the vcores too."""
    groups = []
    for v in size["vcores"]:
        if groups and groups[-1]["vcores"] == v:
            groups[-1]["instances"] += 1
        else:
            groups.append({"name": f"r{len(groups)}", "instances": 1, "vcores": v, "memory": "2 GiB"})
    block = {"name": strategy, "split": list(size["vcores"])} if strategy == "conv_model_parallel" else strategy
    return {"name": "plancheck", "groups": groups,
            "training": {"strategy": block, "model": size["model"], "model_options": size["options"],
                         "data": {"train": "file:///nonexistent"}, "batch_size": size["batch"], "shares": "vcores"}}


# -- inside the MPI world ---------------------------------------------------------------------

def worker(case):
    """One strategy on every rank; rank 0 prints `RESULT {json}`."""
    from launcher.world import LOCAL_WORLD_ENV, join_local
    if case["cgroups"]:
        join_cgroup(case["cgroups"][int(os.environ[LOCAL_WORLD_ENV].split(":")[-2])])
    import torch

    import conf
    from training import collectives, cputime, strategies
    from training.context import RunContext
    from training.models import build_model
    from training.probes import finish, report
    from training.runner import make_optimizer_factory
    comm, rank, n = join_local()
    job = conf.load_job(job_dict(case, case["strategy"]))
    spec = job.training
    ctx = RunContext.offline(comm, job, "plancheck")
    torch.set_num_threads(ctx.me.threads)
    collectives.set_polite(ctx.me.throttled and not case.get("spin"))   # as training.runner does
    collectives.doorbells(comm)
    torch.manual_seed(spec.seed)
    shape = tuple(case["input_shape"])
    model = build_model(spec.model, shape, 10, spec.model_options)
    batches = common.random_batches(spec.batch_size, shape)     # cycled (a fixed batch goes denormal)
    s = strategies.get(spec.strategy.name)(ctx, spec)
    s.setup(model, make_optimizer_factory(spec))
    lo, hi = s.batch_slice(spec.batch_size)
    mine = [(x[lo:hi], y[lo:hi]) if hi > lo or spec.strategy.name != "conv_model_parallel" else (None, None)
            for x, y in batches]
    xs, ys = mine[0]
    feed = itertools.cycle(mine)
    stats = []
    for _ in range(case["warmup"]):
        s.train_step(*next(feed))
    # CPU seconds of this rank's own forward + backward (its rows, the whole model) here,
    # to tell the strategy's own CPU per step (cpu_s_by_rank) from the model's
    probe_x = xs if xs is not None and len(xs) and spec.strategy.name != "conv_model_parallel" else None
    cpu_fb = 0.0
    if probe_x is not None:
        import torch.nn.functional as F
        plain = copy.deepcopy(model)
        c0 = time.process_time()
        for _ in range(5):
            F.cross_entropy(plain(probe_x), ys).backward()
        cpu_fb = (time.process_time() - c0) / 5
    comm.Barrier()
    times = []
    cputime.enable()                            # CPU seconds of a step in waits and conv shares
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(case["steps"]):
        cputime.reset()
        t = time.perf_counter()
        st = s.train_step(*next(feed))
        times.append(time.perf_counter() - t)
        counted = cputime.seconds()
        stats.append((st.compute_s, st.comm_s, counted["wait"], counted["share"]))
    comm.Barrier()
    wall = (time.perf_counter() - t0) / case["steps"]
    cpu = (time.process_time() - cpu0) / case["steps"]
    mine = [statistics.median(st[0] for st in stats), statistics.median(st[1] for st in stats), cpu, cpu_fb,
            statistics.median(st[2] for st in stats), statistics.median(st[3] for st in stats)]
    cputime.enable(False)
    every = comm.gather(mine, root=0)
    s.close()
    if rank == 0:
        report(rank, {"step_s": wall, "step_median_s": statistics.median(times),
                      "compute_s_by_rank": [e[0] for e in every], "comm_s_by_rank": [e[1] for e in every],
                      "cpu_s_by_rank": [e[2] for e in every], "cpu_fwd_bwd_s_by_rank": [e[3] for e in every],
                      "cpu_waits_s_by_rank": [e[4] for e in every], "cpu_shares_s_by_rank": [e[5] for e in every],
                      "rows_rank0": hi - lo})
    finish(comm)


# -- the driver -------------------------------------------------------------------------------

def make_cgroups(vcores, tag, shares=None):
    """One top-level cgroup v1 cpu group per entry of `vcores` with that CFS quota (the
    local engine's period and quota; an entry < 0: no quota) and, given `shares`,
    cpu.shares = shares × |vcores|; or (None, why not).

    Top level, not under the engine's yarnapp/ parent: that parent has one cpu.shares
    weight, which all its containers share against every other process of the machine,
    so on a machine busy with other work the ranks would get less CPU than their quota
    and than the planner's in-process measurement (a top-level process) saw.
    """
    from yarnapp.backends.local.cgroups import PERIOD_US
    if os.geteuid() != 0:
        return None, "not root"
    if not os.path.isfile(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us")):
        return None, f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    paths = []
    try:
        for r, v in enumerate(vcores):
            path = os.path.join(CGROUP_CPU, f"yarnapp-bench-{tag}-{r}")
            os.mkdir(path)
            paths.append(path)
            quota = int(round(v * PERIOD_US)) if v > 0 else -1          # v < 0: no quota
            values = [("cpu.cfs_period_us", PERIOD_US), ("cpu.cfs_quota_us", quota)]
            if shares:
                values.append(("cpu.shares", max(2, int(shares * abs(v)))))
            for name, value in values:
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(value))
    except OSError as e:
        remove_cgroups(paths)
        return None, f"cannot configure cgroups ({e.strerror})"
    return paths, None


def join_cgroup(path):
    """Move this process into the cgroup at `path` (the root cpu group: back out)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def remove_cgroups(paths):
    for path in paths or []:
        for _ in range(50):   # a rank may take a moment to exit
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        else:
            print(f"warning: could not remove {path}", file=sys.stderr)


def run_strategy(case, cgroups, timeout):
    """The strategy of `case` run on its ranks, joined as containers join; rank 0's result."""
    from training import probes
    case = dict(case, cgroups=cgroups)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(case)]
    return probes.run_argv(argv, len(case["vcores"]), timeout=timeout)


def predict(size, link, probes, quick):
    """The planner's plan for configuration `size`: the model measured layer by layer here
    and now; the link, the polite wait's CPU and the strategies' own CPU as measured
    before for this configuration (`probes`)."""
    import conf
    from training import planner
    job = conf.load_job(job_dict(size, "conv_model_parallel"))
    opts = planner.PlanOptions(bandwidths_bps=(link.bandwidth_bps,), latency_s=link.latency_s, machines=(1,),
                               input_shape=size["input_shape"], num_classes=10, min_time=0.05 if quick else 0.2,
                               wait_cpu=probes["wait_cpu"], strategy_cpu=probes["strategy_cpu"])
    return planner.plan_job(job, opts)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter runs and measurements")
    p.add_argument("--seconds", type=float, help="timed seconds per run (default 4, --quick 1.5)")
    p.add_argument("--configs", default="all",
                   help=f"all | tuned | held-out | fresh | names from {', '.join(CONFIGS)} (comma-separated)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--steps", type=int, help="timed steps per run (default: by --seconds)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--reserve", type=int, nargs="?", const=RESERVE_SHARES, default=0, metavar="SHARES",
                   help="give the ranks (and the planner's measurement) cpu.shares = SHARES x vcores "
                        f"(default {RESERVE_SHARES}): their vcores are then theirs on a machine busy with "
                        "other work, as a YARN node reserves them; still capped by the quota")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of every case, interleaved; the table shows the medians (default 1)")
    p.add_argument("--spin", action="store_true",
                   help="throttled ranks wait as MPICH does (spinning), to compare with polite waits")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    common.add_out(p, "planner_check")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def chosen(configs):
    if configs == "all":
        return list(CONFIGS)
    if configs in ("tuned", "held-out", "fresh"):
        return [k for k, (group, _) in CONFIGS.items() if group == configs]
    names = [c for c in configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"Error: --configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    return names


def measure_probes(key, size, reserve):
    """The link, a polite wait's CPU and the strategies' own CPU for one configuration, in a
    cgroup of their own (no quota, the reserved shares) so that a busy machine slows the
    ping-pong no more than it slows the ranks."""
    import conf
    from training import planner
    from training.models import build_model, conv_layers
    link_cg, _ = make_cgroups([-1], f"{os.getpid()}-{key}-link", reserve and reserve * 2)
    try:
        if link_cg:
            join_cgroup(link_cg[0])
        link = planner.measure_link(**planner.local_load(conf.load_job(job_dict(size))))
        convs = [name for name, _ in conv_layers(build_model(size["model"], size["input_shape"], 10,
                                                             size["options"]))]
        probes = {"wait_cpu": planner.measure_wait_cpu(),
                  "strategy_cpu": planner.measure_strategy_cpu(size["model"], size["options"], size["input_shape"],
                                                               10, size["batch"], convs)}
    finally:
        if link_cg:
            join_cgroup(CGROUP_CPU)
            remove_cgroups(link_cg)
    print(f"{key}: link {link.bandwidth_Bps / 1e9:.2f} GB/s, {link.latency_s * 1e6:.2f} us "
          f"({link.source}); polite wait {probes['wait_cpu'][0] * 1e3:.2f} ms + "
          f"{100 * probes['wait_cpu'][1]:.0f}% CPU + {probes['wait_cpu'][2] * 1e12:.0f} us/MB; "
          "strategies' own CPU per step, rank 0 / others: "
          + ", ".join(f"{k} {1e3 * v[0]:.2f}/{1e3 * v[1]:.2f} ms" for k, v in probes["strategy_cpu"].items()),
          file=sys.stderr, flush=True)
    return link, probes


def summary(rows):
    """Within 15%, the median and the largest |error| of a group of cases."""
    errors = [abs(r["error"]) for r in rows]
    return {"within_15pct": sum(e <= TARGET for e in errors), "cases": len(rows),
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors, default=None)}


def print_table(title, rows):
    s = summary(rows)
    print(f"\n{title}: {s['within_15pct']}/{s['cases']} within 15%, median |error| "
          f"{100 * (s['median_abs_error'] or 0):.1f}%, max {100 * (s['max_abs_error'] or 0):.1f}%")
    print(f"{'config':14s} {'ranks (vcores)':16s} {'strategy':20s} {'predicted ms':>12s} {'measured ms':>12s} "
          f"{'error':>8s}")
    for r in rows:
        flag = "" if abs(r["error"]) <= TARGET else "  (outside 15%)"
        vc = "+".join(f"{v:g}" for v in r["vcores"])
        print(f"{r['config']:14s} {vc:16s} {r['strategy']:20s} {r['predicted_s'] * 1e3:12.1f} "
              f"{r['measured_s'] * 1e3:12.1f} {100 * r['error']:+7.1f}%{flag}")


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    from training.probes import stop_cleanly_on_sigterm
    stop_cleanly_on_sigterm()       # a kill or `timeout` still removes the cgroups and ranks
    seconds = a.seconds or (1.5 if a.quick else 4.0)
    warmup = a.warmup if a.warmup is not None else 2
    names = [s for s in a.strategies.split(",") if s]
    keys = chosen(a.configs)
    meta = dict(common.machine_meta(), args=dict(configs=keys, steps=a.steps, seconds=seconds, warmup=warmup,
                                                 reserve_shares=a.reserve, spin=a.spin, repeat=a.repeat),
                configs={k: {"group": CONFIGS[k][0], **CONFIGS[k][1]} for k in keys}, links={}, throttled={},
                probes={})
    runs = []
    for key in keys:
        group, size = CONFIGS[key]
        link, probes = measure_probes(key, size, a.reserve)
        # One cgroup per rank, and one for the planner's in-process measurement: no quota (its
        # co-runners, planner.co_runners, start in it and must not share one core with it),
        # the reserved shares.
        cgroups, why = make_cgroups(list(size["vcores"]) + [-1], f"{os.getpid()}-{key}", a.reserve)
        if why:
            print(f"warning: ranks run unthrottled ({why})", file=sys.stderr)
        meta["links"][key], meta["throttled"][key], meta["probes"][key] = link.as_dict(), cgroups is not None, probes
        try:
            for rep, name in [(r, n) for r in range(a.repeat) for n in names]:
                # Predicted right before the run, so both see the machine as loaded as it is now.
                if cgroups:
                    join_cgroup(cgroups[-1])
                try:
                    plan = predict(size, link, probes, a.quick)
                finally:
                    if cgroups:
                        join_cgroup(CGROUP_CPU)
                pred = plan["strategies"][name]
                steps = a.steps or max(5, min(500, math.ceil(seconds / pred["step_s"])))
                case = dict(size, strategy=name, steps=steps, warmup=warmup, spin=a.spin)
                load = os.getloadavg()[0]
                got = run_strategy(case, cgroups[:-1] if cgroups else None, a.timeout)
                err = (pred["step_s"] - got["step_s"]) / got["step_s"]
                runs.append({"config": key, "group": group, "strategy": name, "repeat": rep,
                             "predicted_s": pred["step_s"], "measured_s": got["step_s"], "error": err,
                             "steps": steps, "loadavg": load, "single_s": plan["single_s"], "predicted": pred,
                             "measured": got})
                print(f"  {key:14s} {name:20s} predicted {pred['step_s'] * 1e3:7.1f} ms  measured "
                      f"{got['step_s'] * 1e3:7.1f} ms  {100 * err:+6.1f}%  (single {plan['single_s'] * 1e3:.1f} ms, "
                      f"load {load:.1f})", file=sys.stderr, flush=True)
        finally:
            remove_cgroups(cgroups)
    # One row per case: the medians over the repeats of the prediction and of the measurement.
    rows = []
    for key in dict.fromkeys((r["config"], r["strategy"]) for r in runs):
        mine = [r for r in runs if (r["config"], r["strategy"]) == key]
        p, m = statistics.median(r["predicted_s"] for r in mine), statistics.median(r["measured_s"] for r in mine)
        rows.append({"config": key[0], "group": mine[0]["group"], "vcores": CONFIGS[key[0]][1]["vcores"],
                     "model": CONFIGS[key[0]][1]["model"], "batch": CONFIGS[key[0]][1]["batch"],
                     "strategy": key[1], "predicted_s": p, "measured_s": m, "error": (p - m) / m,
                     "repeats": len(mine), "runs": mine})
    meta["load_avg_after"] = os.getloadavg()
    meta["summary"] = {g: summary([r for r in rows if r["group"] == g]) for g in ("tuned", "held-out", "fresh")}
    print(f"~{seconds:g} s of timed steps per run, median of {a.repeat} run{'s' if a.repeat > 1 else ''} per "
          "case; shares and kernel split by vcores")
    for group, title in (("tuned", "tuned on (seed_cnn 32/96, batch 32; 1 + 0.5 [+ 0.5] vcores)"),
                         ("held-out", "held out (not fitted on; run after planner changes since 11-24)"),
                         ("fresh", "fresh (added 2026-11-30, not run before their first recorded run)")):
        mine = [r for r in rows if r["group"] == group]
        if mine:
            print_table(title, mine)
    print(f"\nload average {meta['load_avg'][0]:.2f} before, {os.getloadavg()[0]:.2f} after on "
          f"{os.cpu_count()} cpus")
    common.write_results(a.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
