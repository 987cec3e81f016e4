"""The seed's CPU+GPU case: a GPU rank and a CPU rank split the seed network's conv
kernels by measured speed, against the GPU alone (same strategy code, 1 rank).

    mpiexec -n 1 python benchmarks/conv_mp_gpu.py --case gpu
    mpiexec -n 2 python benchmarks/conv_mp_gpu.py --case gpu+cpu
    python benchmarks/conv_mp_gpu.py --all     # runs both under mpiexec, prints the table
Writes benchmarks/results/conv_mp_gpu.json. Rank 0 is the GPU rank (when CUDA is
present); rank 1 computes on the CPU with --cpu-threads threads.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def case_main(args):
    import torch
    from mpi4py import MPI

    from training.context import RankInfo, RunContext
    from training.models import build_model
    from training.strategies.conv_mp.strategy import ConvModelParallelStrategy
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(args.cpu_threads if rank else 2)
    ranks = [RankInfo(rank=r, group="gpu" if r == 0 else "cpu", instance=0, container=f"c_{r}",
                      vcores=args.cpu_threads, memory_mib=4096, gpus=1 if r == 0 else 0) for r in range(n)]
    ctx = RunContext(comm=comm, rank=rank, world_size=n, ranks=ranks, job=None, app_id="bench",
                     generation=0, workdir="/tmp", checkpoint_uri="", logdir="")
    spec = types.SimpleNamespace(batch_size=args.batch, model_parallel=types.SimpleNamespace(
        layers=None, split=None, recalibrate_every=0))
    torch.manual_seed(0)
    model = build_model("seed_cnn", (3, 32, 32), 10, {"conv1": args.conv1, "conv2": args.conv2})
    s = ConvModelParallelStrategy(ctx, spec)
    s.setup(model, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    for _ in range(args.warmup):
        s.train_step(x if rank == 0 else None, y if rank == 0 else None)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        s.train_step(x if rank == 0 else None, y if rank == 0 else None)
    comm.Barrier()
    step = (time.perf_counter() - t0) / args.steps
    if rank == 0:
        print("RESULT " + json.dumps({"case": args.case, "step_s": step, "split": s.layer_split,
                                      "speeds": getattr(s, "speeds", None), "device": str(s.device),
                                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}),
              flush=True)


def run_all(args):
    mpiexec = shutil.which("mpiexec")
    extra = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"] if "Open MPI" in subprocess.run(
        [mpiexec, "--version"], capture_output=True, text=True).stdout else []
    out = {}
    for case, n in (("gpu", 1), ("gpu+cpu", 2)):
        cmd = [mpiexec, *extra, "-n", str(n), sys.executable, __file__, "--case", case,
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("case", "all")]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        out[case] = json.loads(line[7:])
    ratio = out["gpu"]["step_s"] / out["gpu+cpu"]["step_s"]
    print(f"{'case':<10} {'step s':>9}  split (kernels per rank, per layer)")
    for case, r in out.items():
        print(f"{case:<10} {r['step_s']:>9.4f}  {r['split']}")
    print(f"GPU+CPU speedup over the GPU alone: {ratio:.3f}x  (device: {out['gpu']['gpu']}, "
          f"conv {args.conv1}/{args.conv2}, batch {args.batch}, CPU rank {args.cpu_threads} threads)")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "conv_mp_gpu.json"), "w") as f:
        json.dump({"cases": out, "speedup_gpu_cpu_over_gpu": ratio, "args": vars(args)}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=["gpu", "gpu+cpu"])
    p.add_argument("--all", action="store_true")
    p.add_argument("--conv1", type=int, default=500)
    p.add_argument("--conv2", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=14)
    p.add_argument("--timeout", type=float, default=240)
    args = p.parse_args()
    if args.all:
        run_all(args)
    else:
        case_main(args)


if __name__ == "__main__":
    main()
