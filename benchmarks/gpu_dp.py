"""Data parallelism with a GPU: the GPU alone, the GPU with CPU ranks beside it, and ours
against torch DDP over NCCL on the same GPU. Needs a CUDA machine (the device tool);
elsewhere it says so in one line and exits 2.

    python benchmarks/gpu_dp.py [--quick] [--repeat 3] [--cpus 2] [--cpu-vcores 4]

Every contender is a real `yarnapp submit` on the local engine (the GPU container gets
exactly its GPU through CUDA_VISIBLE_DEVICES; CPU containers get none), in interleaved
rounds; medians.

mixed   the built-in runner, ResNet-20 on synthetic CIFAR-shaped data, shares by speed:
          gpu-alone   one container with the GPU
          gpu+cpus    the GPU container and --cpus CPU containers of --cpu-vcores
        with `yarnapp plan`'s predicted samples/s beside each (measured on this machine).
ddp     a user's loop (benchmarks/own_loop_train.py) on one GPU: training.dist (ours) and
        DistributedDataParallel over NCCL, each against the plain loop without
        torch.distributed (`plain`): ratios ours / plain and ddp / plain, the median of each
        round's. (On one GPU ours sums nothing and DDP runs a one-rank all-reduce: ours
        against DDP there is no measure of the exchange, which needs several GPUs.)

Writes benchmarks/results/gpu_dp.json.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, fewer steps")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2, help="CPU containers beside the GPU")
    p.add_argument("--cpu-vcores", type=float, default=4.0)
    p.add_argument("--gpu-vcores", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 200)")
    common.add_out(p, "gpu_dp")
    return p.parse_args(argv)


def groups(args, cpus):
    g = [{"name": "gpu", "instances": 1, "vcores": args.gpu_vcores, "gpus": 1, "memory": "8 GiB"}]
    if cpus:
        g.append({"name": "cpu", "instances": cpus, "vcores": args.cpu_vcores, "memory": "4 GiB"})
    return g


def mixed_job(args, data, cpus, steps):
    return {"name": f"gpu-dp-{cpus}cpu", "groups": groups(args, cpus), "max_restarts": 0,
            "training": {"strategy": "allreduce", "model": "resnet", "shares": "speed", "batch_size": 256,
                         "max_steps": steps, "data": {"train": f"{data}/train"}},
            "checkpoint": {"every_steps": None}}


# what rank 0 says of the shares: the measured passes and weights, and a rank that costs
# more than it saves (training.strategies.allreduce)
SHARE_LINES = ("shares 'speed'", "costs more than it saves")


def predicted(job):
    import conf
    from training import planner
    plan = planner.plan_job(conf.load_job(job), planner.parse_options(quick=True, machines="1"))
    name = "allreduce"
    p = plan["speed_shares"].get(name) or plan["strategies"][name]
    return job["training"]["batch_size"] / p["step_s"]


def ddp_run(api, work, args, steps):
    out = os.path.join(work, f"{api}.json")
    cmd = ["--api", api, "--out", out, "--steps", str(steps), "--batch", "256", "--shares", "equal"]
    common.submit({"name": f"gpu-loop-{api}", "groups": groups(args, 0), "max_restarts": 0,
                   "run": {"script": os.path.join(HERE, "own_loop_train.py"), "args": cmd,
                           "files": [os.path.join(HERE, "own_loop_train.py")]}})
    with open(out) as f:
        got = json.load(f)
    if got.get("device") != "cuda":
        sys.exit(f"Error: the {api} loop ran on {got.get('device')}, not on the GPU")
    return got["samples_per_s"]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, ROOT)
    import torch
    if not torch.cuda.is_available():
        print("no GPU here: benchmarks/gpu_dp.py needs a CUDA device (run it on the GPU machine)", file=sys.stderr)
        return 2
    rounds = 1 if args.quick else args.repeat
    steps = args.steps or (40 if args.quick else 200)
    home = tempfile.mkdtemp(prefix="yarnapp-bench-")
    os.environ["YARNAPP_HOME"] = os.path.join(home, "home")
    samples, predictions, waits, notes = {}, {}, {}, {}
    t0 = time.time()
    try:
        from training.data import import_synthetic_cifar
        data = os.path.join(home, "cifar")
        import_synthetic_cifar(data, n_train=20000, n_test=500)
        for name, cpus in (("gpu-alone", 0), ("gpu+cpus", args.cpus)):
            predictions[name] = predicted(mixed_job(args, data, cpus, steps))
        for r in range(rounds):
            contenders = ["gpu-alone", "gpu+cpus", "ours", "ddp", "plain"]
            if r % 2:
                contenders.reverse()
            for name in contenders:
                if name in ("ours", "ddp", "plain"):
                    v = ddp_run(name, home, args, steps)
                else:
                    cpus = 0 if name == "gpu-alone" else args.cpus
                    st = common.submit(mixed_job(args, data, cpus, steps), log_lines=SHARE_LINES)
                    final, v = st["final"], st["final"]["samples_per_s"]
                    waits.setdefault(name, []).append(final["data_wait_pct"])
                    notes[name] = [line for line in st["log_lines"] if "rank0 " in line]
                    for line in notes[name]:
                        print("   ", line.split(": ", 1)[-1], flush=True)
                samples.setdefault(name, []).append(v)
                print(f"round {r + 1}: {name}: {v:.1f} samples/s", flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}

    def per_round(a, b):            # the median of each round's ratio a / b (drift hits both alike)
        return statistics.median(x / y for x, y in zip(samples[a], samples[b]))
    rows = []
    print(f"\n{'contender':<10} {'samples/s':>10} {'predicted':>10} {'data wait':>9}  ratio")
    for name, m in med.items():
        row = {"contender": name, "samples_per_s": m, "runs": samples[name], "predicted": predictions.get(name)}
        if name in waits:
            row.update(data_wait_pct=statistics.median(waits[name]), rank0_said=notes[name])
        if name == "gpu+cpus":
            row.update(vs="gpu-alone", ratio=per_round(name, "gpu-alone"))
        if name in ("ours", "ddp"):     # on one GPU: against a plain loop (ours alone sums nothing)
            row.update(vs="plain", ratio=per_round(name, "plain"))
        rows.append(row)
        pred = f"{row['predicted']:10.1f}" if row["predicted"] else f"{'':>10}"
        ratio = f"{row['ratio']:.2f}x {row['vs']}" if 'ratio' in row else ''
        wait = f"{row['data_wait_pct']:8.1f}%" if "data_wait_pct" in row else f"{'':>9}"
        print(f"{name:<10} {m:>10.1f} {pred} {wait}  {ratio}")
    meta = {**common.machine_meta(), "gpu": torch.cuda.get_device_name(0), "rounds": rounds, "steps": steps,
            "cpu_containers": args.cpus, "cpu_vcores": args.cpu_vcores, "wall_s": round(time.time() - t0, 1)}
    common.write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
