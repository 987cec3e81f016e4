"""The planner's predicted step time against the real strategies, with 2 and 3 ranks.

    python benchmarks/planner_check.py            # seed_cnn 32/96, batch 32, ~4 s of steps per run
    python benchmarks/planner_check.py --quick    # ~1.5 s of steps per run
    python benchmarks/planner_check.py --reserve  # the ranks' vcores reserved on a busy machine
    python benchmarks/planner_check.py --ranks 2 --strategies allreduce,ps_central
    python benchmarks/planner_check.py --reserve --repeat 3   # medians of 3 interleaved runs

For every world size n (2 and 3): the containers of a job with a group `big`
(1 × 1 vcore) and a group `small` ((n−1) × 0.5 vcore), shares 'vcores', kernels
split by the same weights. The planner (training.planner, the code behind `yarnapp
plan`) measures the link once per world size with its ping-pong of two joined ranks
and, right before each run (so that both see the machine as loaded as it is then), the
model layer by layer in this process, and predicts the strategy's step time. Then the
strategy runs for real: n processes joined into one world as the engine's containers
join (launcher.world.spawn_local: MPI singletons, Connect/Accept), every rank
in its own cgroup with the CPU quota of its vcores as the local engine sets it
(100 ms CFS period; see make_cgroups for why not under the engine's parent), ceil(vcores) torch
threads, polite waits where throttled (as training.runner sets them), a RunContext like
the launcher's, the strategy from the registry, a fixed
random batch; measured step time = wall time of the timed steps between two barriers
/ their number, after warm-up steps. The timed steps last about `--seconds` by the
prediction (at least 5 steps): a 0.5-vcore rank runs 50 ms of every 100 ms CFS period,
so a run of a few steps would measure where the periods happened to fall.

Prints predicted, measured and error % per strategy and world size (target: within
15%) and writes benchmarks/results/planner_check.json. Needs root and cgroup v1 for
the quotas; without them every rank runs unthrottled and the error says little.
"""
import argparse
import copy
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


def job_dict(ranks, model, options, batch, strategy="allreduce"):
    """The job of one world size: big (1 × 1 vcore) + small ((ranks−1) × 0.5 vcore)."""
    groups = [{"name": "big", "instances": 1, "vcores": 1, "memory": "2 GiB"}]
    if ranks > 1:
        groups.append({"name": "small", "instances": ranks - 1, "vcores": 0.5, "memory": "2 GiB"})
    vcores = [1.0] + [0.5] * (ranks - 1)
    return {"name": "plancheck", "groups": groups,
            "training": {"strategy": {"name": strategy, "split": vcores} if strategy == "conv_model_parallel"
                         else strategy, "model": model, "model_options": options,
                         "data": {"train": "file:///nonexistent"}, "batch_size": batch, "shares": "vcores"}}


# -- inside the MPI world ---------------------------------------------------------------------

def worker(case):
    """One strategy on every rank; rank 0 prints `RESULT {json}`."""
    from launcher.world import LOCAL_WORLD_ENV, join_local
    if case["cgroups"]:
        join_cgroup(case["cgroups"][int(os.environ[LOCAL_WORLD_ENV].split(":")[-2])])
    import torch

    import conf
    from training import collectives
    counted = {"waits": 0.0, "shares": 0.0}     # CPU seconds of a step in waits and conv shares

    def counting(f, key):
        def run(*args, **kwargs):
            c = time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                counted[key] += time.process_time() - c
        return run

    collectives.wait = counting(collectives.wait, "waits")   # before the strategies bind it
    from training import model_parallel, strategies
    for name in ("forward", "backward"):
        setattr(model_parallel._ShardConv2d, name,
                staticmethod(counting(getattr(model_parallel._ShardConv2d, name), "shares")))
    from training.context import RunContext
    from training.models import build_model
    from training.runner import make_optimizer_factory
    comm, rank, n = join_local()
    job = conf.load_job(job_dict(n, case["model"], case["options"], case["batch"], case["strategy"]))
    spec = job.training
    ctx = RunContext.offline(comm, job, "plancheck")
    torch.set_num_threads(ctx.me.threads)
    collectives.set_polite(ctx.me.throttled and not case["spin"])   # as training.runner does
    torch.manual_seed(spec.seed)
    shape = tuple(case["input_shape"])
    model = build_model(spec.model, shape, 10, spec.model_options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(spec.batch_size, *shape, generator=g)
    y = torch.randint(0, 10, (spec.batch_size,), generator=g)
    s = strategies.get(spec.strategy.name)(ctx, spec)
    s.setup(model, make_optimizer_factory(spec))
    lo, hi = s.batch_slice(spec.batch_size)
    xs, ys = (x[lo:hi], y[lo:hi]) if hi > lo or spec.strategy.name != "conv_model_parallel" else (None, None)
    stats = []
    for _ in range(case["warmup"]):
        s.train_step(xs, ys)
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
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(case["steps"]):
        counted.update(waits=0.0, shares=0.0)
        t = time.perf_counter()
        st = s.train_step(xs, ys)
        times.append(time.perf_counter() - t)
        stats.append((st.compute_s, st.comm_s, counted["waits"], counted["shares"]))
    comm.Barrier()
    wall = (time.perf_counter() - t0) / case["steps"]
    cpu = (time.process_time() - cpu0) / case["steps"]
    mine = [statistics.median(st[0] for st in stats), statistics.median(st[1] for st in stats), cpu, cpu_fb,
            statistics.median(st[2] for st in stats), statistics.median(st[3] for st in stats)]
    every = comm.gather(mine, root=0)
    if hasattr(s, "close"):
        s.close()
    if rank == 0:
        print("RESULT " + json.dumps({"step_s": wall, "step_median_s": statistics.median(times),
                                      "compute_s_by_rank": [e[0] for e in every],
                                      "comm_s_by_rank": [e[1] for e in every],
                                      "cpu_s_by_rank": [e[2] for e in every],
                                      "cpu_fwd_bwd_s_by_rank": [e[3] for e in every],
                                      "cpu_waits_s_by_rank": [e[4] for e in every],
                                      "cpu_shares_s_by_rank": [e[5] for e in every],
                                      "rows_rank0": hi - lo}), flush=True)


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


def run_strategy(ranks, case, cgroups, timeout):
    case = dict(case, cgroups=cgroups)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    from launcher.world import run_local
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(case)]
    outs = run_local(cmd, ranks, env=env, timeout=timeout)
    lines = [ln for ln in outs[0][1].splitlines() if ln.startswith("RESULT ")]
    if any(rc for rc, _, _ in outs) or not lines:
        raise RuntimeError(f"{case['strategy']} on {ranks} ranks failed ({[rc for rc, _, _ in outs]}):\n"
                           + "\n".join(o[-2000:] + e[-2000:] for _, o, e in outs))
    return json.loads(lines[-1][len("RESULT "):])


def predict(ranks, size, link, probes, quick):
    """The planner's plan for the world of `ranks`: the model measured layer by layer here
    and now; the link, the polite wait's CPU and the strategies' own CPU as measured
    before for this world size (`probes`)."""
    import conf
    from training import planner
    job = conf.load_job(job_dict(ranks, size["model"], size["options"], size["batch"], "conv_model_parallel"))
    opts = planner.PlanOptions(bandwidths_bps=(link.bandwidth_bps,), latency_s=link.latency_s, machines=(1,),
                               input_shape=size["input_shape"], num_classes=10, min_time=0.05 if quick else 0.2,
                               wait_cpu=probes["wait_cpu"], strategy_cpu=probes["strategy_cpu"])
    return planner.plan_job(job, opts)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter runs and measurements")
    p.add_argument("--seconds", type=float, help="timed seconds per run (default 4, --quick 1.5)")
    p.add_argument("--ranks", default="2,3", help="world sizes (default 2,3)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--model", default="seed_cnn")
    p.add_argument("--options", default='{"conv1": 32, "conv2": 96}', help="model options as JSON")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-shape", default="3x32x32")
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
    p.add_argument("--out", default=os.path.join(HERE, "results", "planner_check.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    size = {"model": a.model, "options": json.loads(a.options), "batch": a.batch,
            "input_shape": [int(s) for s in a.input_shape.split("x")]}
    seconds = a.seconds or (1.5 if a.quick else 4.0)
    warmup = a.warmup if a.warmup is not None else 2
    names = [s for s in a.strategies.split(",") if s]
    meta = dict(common.machine_meta(), args=dict(size, steps=a.steps, seconds=seconds, warmup=warmup,
                                                 reserve_shares=a.reserve, spin=a.spin, repeat=a.repeat),
                links={}, throttled={})
    rows, runs = [], []
    from training import planner
    for ranks in [int(r) for r in a.ranks.split(",")]:
        # The link, measured in a cgroup of its own (no quota, the reserved shares) so that a
        # busy machine slows the ping-pong no more than it slows the ranks.
        link_cg, _ = make_cgroups([-1], f"{os.getpid()}-{ranks}-link", a.reserve and a.reserve * 2)
        try:
            if link_cg:
                join_cgroup(link_cg[0])
            import conf
            job = conf.load_job(job_dict(ranks, size["model"], size["options"], size["batch"]))
            link = planner.measure_link(**planner.local_load(job))
            from training.models import build_model, conv_layers
            convs = [name for name, _ in conv_layers(build_model(size["model"], size["input_shape"], 10,
                                                                 size["options"]))]
            probes = {"wait_cpu": planner.measure_wait_cpu(),
                      "strategy_cpu": planner.measure_strategy_cpu(size["model"], size["options"],
                                                                   size["input_shape"], 10, size["batch"], convs)}
        finally:
            if link_cg:
                join_cgroup(CGROUP_CPU)
                remove_cgroups(link_cg)
        print(f"{ranks} ranks: link {link.bandwidth_Bps / 1e9:.2f} GB/s, {link.latency_s * 1e6:.2f} us "
              f"({link.source}); polite wait {probes['wait_cpu'][0] * 1e3:.2f} ms + "
              f"{100 * probes['wait_cpu'][1]:.0f}% CPU + {probes['wait_cpu'][2] * 1e12:.0f} us/MB; "
              "strategies' own CPU per step, rank 0 / others: "
              + ", ".join(f"{k} {'-' if v[0] is None else f'{1e3 * v[0]:.2f}'}/{1e3 * v[1]:.2f} ms"
                          for k, v in probes["strategy_cpu"].items()),
              file=sys.stderr, flush=True)
        # One cgroup per rank, and one for the planner's in-process measurement: no quota (its
        # co-runners, planner.co_runners, start in it and must not share one core with it),
        # the reserved shares.
        cgroups, why = make_cgroups([1.0] + [0.5] * (ranks - 1) + [-1], f"{os.getpid()}-{ranks}", a.reserve)
        if why:
            print(f"warning: ranks run unthrottled ({why})", file=sys.stderr)
        meta["links"][ranks], meta["throttled"][ranks] = link.as_dict(), cgroups is not None
        meta.setdefault("probes", {})[ranks] = probes
        try:
            for rep, name in [(r, n) for r in range(a.repeat) for n in names]:
                # Predicted right before the run, so both see the machine as loaded as it is now.
                if cgroups:
                    join_cgroup(cgroups[-1])
                try:
                    plan = predict(ranks, size, link, probes, a.quick)
                finally:
                    if cgroups:
                        join_cgroup(CGROUP_CPU)
                pred = plan["strategies"][name]
                steps = a.steps or max(5, min(500, math.ceil(seconds / pred["step_s"])))
                case = dict(size, strategy=name, steps=steps, warmup=warmup, spin=a.spin)
                load = os.getloadavg()[0]
                got = run_strategy(ranks, case, cgroups[:-1] if cgroups else None, a.timeout)
                err = (pred["step_s"] - got["step_s"]) / got["step_s"]
                runs.append({"ranks": ranks, "strategy": name, "repeat": rep, "predicted_s": pred["step_s"],
                             "measured_s": got["step_s"], "error": err, "steps": steps, "loadavg": load,
                             "single_s": plan["single_s"], "predicted": pred, "measured": got})
                print(f"  {ranks} ranks {name:20s} predicted {pred['step_s'] * 1e3:7.1f} ms  measured "
                      f"{got['step_s'] * 1e3:7.1f} ms  {100 * err:+6.1f}%  (single {plan['single_s'] * 1e3:.1f} ms, "
                      f"load {load:.1f})", file=sys.stderr, flush=True)
        finally:
            remove_cgroups(cgroups)
    # One row per case: the medians over the repeats of the prediction and of the measurement.
    for key in dict.fromkeys((r["ranks"], r["strategy"]) for r in runs):
        mine = [r for r in runs if (r["ranks"], r["strategy"]) == key]
        p, m = statistics.median(r["predicted_s"] for r in mine), statistics.median(r["measured_s"] for r in mine)
        rows.append({"ranks": key[0], "strategy": key[1], "predicted_s": p, "measured_s": m,
                     "error": (p - m) / m, "repeats": len(mine), "runs": mine})
    within = [abs(r["error"]) <= TARGET for r in rows]
    meta["load_avg_after"] = os.getloadavg()
    meta["summary"] = {"within_15pct": sum(within), "cases": len(rows),
                       "max_abs_error": max((abs(r["error"]) for r in rows), default=None)}
    print(f"{size['model']} {size['options']}, batch {size['batch']}, ~{seconds:g} s of timed steps per run, "
          f"median of {a.repeat} run{'s' if a.repeat > 1 else ''} per case; "
          f"ranks: big 1 vcore + (n-1) small 0.5 vcore, shares vcores")
    print(f"{'ranks':>5s} {'strategy':20s} {'predicted ms':>12s} {'measured ms':>12s} {'error':>8s}")
    for r in rows:
        flag = "" if abs(r["error"]) <= TARGET else "  (outside 15%)"
        print(f"{r['ranks']:5d} {r['strategy']:20s} {r['predicted_s'] * 1e3:12.1f} {r['measured_s'] * 1e3:12.1f} "
              f"{100 * r['error']:+7.1f}%{flag}")
    print(f"{sum(within)}/{len(rows)} within 15%; load average {meta['load_avg'][0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after on {os.cpu_count()} cpus")
    common.write_results(a.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
