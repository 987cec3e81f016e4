"""Samples per second of the two parameter servers against the ring, same model and ranks.

    python benchmarks/ps_vs_ring.py            # ~4 s of steps per run
    python benchmarks/ps_vs_ring.py --quick    # ~1.5 s of steps per run
    python benchmarks/ps_vs_ring.py --reserve  # the ranks' vcores reserved on a busy machine

For each model (seed_cnn 32/96: compute-bound, 0.56 MB of gradients; mlp 1024x2:
communication-heavy, 17 MB of gradients), each world size (2 and 3 ranks: a 1-vcore
rank and 0.5-vcore ranks, shares 'vcores', the worlds of planner_check.py) and each of
allreduce, ps_central and ps_sharded: a real MPI world runs the strategy on 16 cycled
random batches (each rank in a cgroup with its vcores' CPU quota) and the timed steps give
samples/s = global batch / step time; `--repeat` interleaved rounds (default 3, the order
rotated each round), the median reported. Seed 4 expects, per step, 2(n−1)/n·c of
communication for the ring and the sharded server and 2(n−1)c for the central one
(c = |W| / bandwidth), so the central server falls behind as n and |W| grow.

Prints a table and writes benchmarks/results/ps_vs_ring.json.
"""
import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402  (machine description, JSON writer)
import planner_check as pc  # noqa: E402  (the worker, the cgroups, the job of a world size)

STRATEGIES = ("allreduce", "ps_central", "ps_sharded")
MODELS = {
    "seed_cnn": {"model": "seed_cnn", "options": {"conv1": 32, "conv2": 96}, "batch": 32, "input_shape": [3, 32, 32]},
    "mlp": {"model": "mlp", "options": {"hidden": 1024, "layers": 2}, "batch": 32, "input_shape": [3, 32, 32]},
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter runs")
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--seconds", type=float, help="timed seconds per run (default 4, --quick 1.5)")
    p.add_argument("--reserve", type=int, nargs="?", const=pc.RESERVE_SHARES, default=0, metavar="SHARES",
                   help="cpu.shares = SHARES x vcores for the ranks (see planner_check.py)")
    p.add_argument("--repeat", type=int, default=None, help="interleaved rounds, medians (default 3, --quick 1)")
    p.add_argument("--timeout", type=float, default=600)
    common.add_out(p, "ps_vs_ring")
    a = p.parse_args(argv)
    seconds = a.seconds or (1.5 if a.quick else 4.0)
    a.repeat = a.repeat or (1 if a.quick else 3)
    load_before = os.getloadavg()
    results = []
    for model in [m for m in a.models.split(",") if m]:
        size = MODELS[model]
        for ranks in [int(r) for r in a.ranks.split(",")]:
            cgroups, why = pc.make_cgroups([1.0] + [0.5] * (ranks - 1), f"psring-{os.getpid()}-{ranks}", a.reserve)
            if why:
                print(f"warning: ranks run unthrottled ({why})", file=sys.stderr)
            try:
                steps = {}
                for name in STRATEGIES:         # a short run sizes each strategy's timed runs to ~`seconds`
                    case = dict(size, vcores=[1.0] + [0.5] * (ranks - 1), strategy=name, steps=5, warmup=2)
                    steps[name] = max(5, min(500, math.ceil(seconds / pc.run_strategy(case, cgroups, a.timeout)["step_s"])))
                runs = {name: [] for name in STRATEGIES}
                for r in range(a.repeat):      # interleaved rounds, the order rotated: drift hits all alike
                    for name in STRATEGIES[r % 3:] + STRATEGIES[:r % 3]:
                        case = dict(size, vcores=[1.0] + [0.5] * (ranks - 1), strategy=name, steps=steps[name],
                                    warmup=2)
                        runs[name].append(pc.run_strategy(case, cgroups, a.timeout))
                for name in STRATEGIES:
                    got = sorted(runs[name], key=lambda g: g["step_s"])[len(runs[name]) // 2]     # the median run
                    rec = {"model": model, "ranks": ranks, "strategy": name, "steps": steps[name],
                           "step_s": got["step_s"], "samples_per_s": size["batch"] / got["step_s"],
                           "rounds_samples_per_s": [size["batch"] / g["step_s"] for g in runs[name]],
                           "comm_s_rank0": got["comm_s_by_rank"][0],
                           "comm_s_max": max(got["comm_s_by_rank"]), "loadavg": os.getloadavg()[0]}
                    results.append(rec)
                    print(f"  {model:8s} {ranks} ranks {name:11s} {rec['samples_per_s']:8.1f} samples/s (median of "
                          f"{a.repeat})", file=sys.stderr, flush=True)
            finally:
                pc.remove_cgroups(cgroups)
    ring = {(r["model"], r["ranks"]): r["samples_per_s"] for r in results if r["strategy"] == "allreduce"}
    for r in results:
        r["vs_ring"] = r["samples_per_s"] / ring[(r["model"], r["ranks"])]
    meta = dict(common.machine_meta(), load_avg_after=os.getloadavg(),
                args={"seconds": seconds, "reserve_shares": a.reserve, "repeat": a.repeat,
                      "models": {m: MODELS[m] for m in a.models.split(",") if m}})
    meta["load_avg"] = load_before
    print(f"{'model':8s} {'ranks':>5s} {'strategy':11s} {'samples/s':>10s} {'vs ring':>8s} {'ms/step':>8s} "
          f"{'comm ms (rank 0)':>16s}")
    for r in results:
        print(f"{r['model']:8s} {r['ranks']:5d} {r['strategy']:11s} {r['samples_per_s']:10.1f} {r['vs_ring']:8.2f} "
              f"{r['step_s'] * 1e3:8.1f} {r['comm_s_rank0'] * 1e3:16.1f}")
    print(f"ranks: 1 x 1 vcore + (n-1) x 0.5 vcore, shares vcores, batch 32; load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after on {os.cpu_count()} cpus")
    common.write_results(a.out, meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
