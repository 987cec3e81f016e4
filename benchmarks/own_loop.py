"""Users' own loops and the example job on unequal containers, through real `yarnapp submit`s.

    python benchmarks/own_loop.py [--quick] [--repeat 3] [--parts loop,example,conv-mp,seed]

Every contender runs as an application of the local engine on 1 x 1 vcore + 2 x 0.5
vcore containers (cgroup CPU quotas, singletons joined through the store: the product's
path), in interleaved rounds; the table gives medians over rounds, and ratios the
median of each round's.

loop     a user's training loop (benchmarks/own_loop_train.py: ResNet-20, CIFAR-shaped
         rows in memory, global batch 96, SGD), shipped as run.script:
           ours-vcores  on training.dist, shares by vcores (48/24/24 rows)
           ours-equal   on training.dist, equal shares (32/32/32 rows): ours against DDP
                        alone, without the shares' gain
           ddp-equal    torch DistributedDataParallel over gloo with DistributedSampler
                        (32/32/32 rows: equal shares are all torch offers), env://
                        rendezvous from the launcher's variables, as torchrun runs it
         samples/s over the steps after a warm-up; ratios ours / ddp.
example  conf/examples/cifar_resnet.yaml (the built-in runner) for --steps steps:
           one-1vcore   a single container of 1 vcore
           equal        the three containers, shares: equal
           vcores       the three containers, shares: vcores
         samples/s of the whole run (final metrics); ratios against one-1vcore and equal.
conv-mp  (not in the default parts) the same example with strategy conv_model_parallel
         (kernels split by measured speed, recalibrated every 5 steps) on the three
         containers, against one-1vcore.
seed     (not in the default parts) conv-MP where it is meant to run: the seed network
         (seed_cnn, conv widths 128/384 as benchmarks/conv_mp.py --quick, batch 16) on the
         same data, the example's job otherwise:
           seed-1vcore  a single container of 1 vcore (strategy allreduce, one rank)
           seed-conv-mp the three containers, conv_model_parallel as above

Writes benchmarks/results/own_loop.json.
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
GROUPS = [{"name": "big", "instances": 1, "vcores": 1, "memory": "2 GiB"},
          {"name": "small", "instances": 2, "vcores": 0.5, "memory": "2 GiB"}]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, fewer steps")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    p.add_argument("--parts", default="loop,example")
    p.add_argument("--steps", type=int, default=None, help="example: training steps per run (default 60)")
    common.add_out(p, "own_loop")
    return p.parse_args(argv)


def loop_run(name, work, quick):
    api, shares = name.split("-")
    out = os.path.join(work, f"{name}.json")
    args = ["--api", api, "--out", out, "--steps", "12" if quick else "30"]
    if api == "ours":
        args += ["--shares", shares]
    common.submit({"name": f"loop-{name}", "groups": GROUPS, "max_restarts": 0,
            "run": {"script": os.path.join(HERE, "own_loop_train.py"), "args": args,
                    "files": [os.path.join(HERE, "own_loop_train.py")]}})
    with open(out) as f:
        return json.load(f)["samples_per_s"]


def example_run(kind, data, steps):
    import yarnapp
    job = yarnapp.load(os.path.join(ROOT, "conf", "examples", "cifar_resnet.yaml")).model_dump(mode="python")
    job["training"]["data"] = {**job["training"]["data"], "train": f"{data}/train", "test": None}
    job["training"]["max_steps"] = steps
    job["checkpoint"]["every_steps"] = None
    job["name"] = f"example-{kind}"
    if kind.startswith("seed-"):
        job["training"].update(model="seed_cnn", model_options={"conv1": 128, "conv2": 384}, batch_size=16,
                               shares="equal")
    if kind in ("one-1vcore", "seed-1vcore"):
        job["groups"] = [{**job["groups"][0], "instances": 1}]
    elif kind in ("conv-mp", "seed-conv-mp"):
        job["training"]["strategy"] = {"name": "conv_model_parallel", "recalibrate_every": 5}
    else:
        job["training"]["shares"] = kind
    return common.submit(job)["final"]["samples_per_s"]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    parts = args.parts.split(",")
    rounds = 1 if args.quick else args.repeat
    steps = args.steps or (20 if args.quick else 60)
    home = tempfile.mkdtemp(prefix="yarnapp-bench-")
    os.environ["YARNAPP_HOME"] = os.path.join(home, "home")
    sys.path.insert(0, ROOT)
    samples = {}
    t0 = time.time()
    try:
        if "example" in parts or "conv-mp" in parts or "seed" in parts:
            from training.data import import_synthetic_cifar
            import_synthetic_cifar(os.path.join(home, "cifar"), n_train=8000, n_test=500)
        for r in range(rounds):
            contenders = []
            if "loop" in parts:
                contenders += [("loop", "ours-vcores"), ("loop", "ours-equal"), ("loop", "ddp-equal")]
            if "example" in parts:
                contenders += [("example", k) for k in ("one-1vcore", "equal", "vcores")]
            if "conv-mp" in parts:
                if "example" not in parts:          # its baseline
                    contenders.append(("example", "one-1vcore"))
                contenders.append(("example", "conv-mp"))
            if "seed" in parts:
                contenders += [("seed", "seed-1vcore"), ("seed", "seed-conv-mp")]
            if r % 2:
                contenders.reverse()
            for part, name in contenders:
                if part == "loop":
                    v = loop_run(name, home, args.quick)
                else:
                    v = example_run(name, os.path.join(home, "cifar"), steps)
                samples.setdefault((part, name), []).append(v)
                print(f"round {r + 1}: {part} {name}: {v:.1f} samples/s", flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}

    def per_round(a, b):            # the median of each round's ratio a / b (drift hits both alike)
        return statistics.median(x / y for x, y in zip(samples[a], samples[b]))
    rows = []
    print(f"\n{'part':<8} {'contender':<12} {'samples/s':>10}  ratio")
    for (part, name), m in med.items():
        base = {"loop": ("loop", "ddp-equal"), "example": ("example", "one-1vcore"),
                "seed": ("seed", "seed-1vcore")}[part]
        ratio = {"vs": base[1], "ratio": per_round((part, name), base)} if base in med and base != (part, name) \
            else {}
        if part == "example" and name == "vcores" and ("example", "equal") in med:
            ratio["vs_equal"] = per_round((part, name), ("example", "equal"))
        rows.append({"part": part, "contender": name, "samples_per_s": m, "runs": samples[(part, name)], **ratio})
        extra = f"{ratio['ratio']:.2f}x {ratio['vs']}" if ratio else ""
        if "vs_equal" in ratio:
            extra += f", {ratio['vs_equal']:.2f}x equal"
        print(f"{part:<8} {name:<12} {m:>10.1f}  {extra}")
    meta = {**common.machine_meta(), "rounds": rounds, "example_steps": steps, "quick": args.quick,
            "wall_s": round(time.time() - t0, 1), "groups": "1 x 1 vcore + 2 x 0.5 vcore (local engine, cgroups)"}
    common.write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
