"""The seed's CPU+GPU case: a GPU rank and a CPU rank split the seed network's conv
kernels by measured speed, against the GPU alone (same strategy code, 1 rank).

    python benchmarks/conv_mp_gpu.py --all     # runs both cases, prints the table

Each case runs on ranks joined as an application's containers join (1 rank "gpu", 2
ranks "gpu+cpu"; training.probes.run_argv). Writes benchmarks/results/conv_mp_gpu.json.
Rank 0 is the GPU rank (when CUDA is present); rank 1 computes on the CPU with
--cpu-threads threads.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def case_main(args):
    import torch

    import conf
    from launcher.world import join_local
    from training.context import RunContext
    from training.models import build_model
    from training.probes import finish, report
    from training.strategies.conv_mp.strategy import ConvModelParallelStrategy
    comm, rank, n = join_local()
    torch.set_num_threads(args.cpu_threads if rank else 2)
    job = conf.offline_job([float(args.cpu_threads)] * n, gpus=[1] + [0] * (n - 1), name="bench",
                           strategy="conv_model_parallel", model="seed_cnn", batch_size=args.batch)
    ctx, spec = RunContext.offline(comm, job, "bench"), job.training
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
    report(rank, {"case": args.case, "step_s": step, "split": s.layer_split, "speeds": s.speeds,
                  "device": str(s.device),
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None})
    finish(comm)


def run_all(args):
    from training import probes
    out = {}
    for case, n in (("gpu", 1), ("gpu+cpu", 2)):
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case,
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("case", "all")]]
        try:
            out[case] = probes.run_argv(cmd, n, timeout=args.timeout)
        except probes.ProbeError as e:
            raise SystemExit(f"{case} failed: {e}\n{getattr(e, 'output', '')}") from None
    ratio = out["gpu"]["step_s"] / out["gpu+cpu"]["step_s"]
    print(f"{'case':<10} {'step s':>9}  split (kernels per rank, per layer)")
    for case, r in out.items():
        print(f"{case:<10} {r['step_s']:>9.4f}  {r['split']}")
    print(f"GPU+CPU speedup over the GPU alone: {ratio:.3f}x  (device: {out['gpu']['gpu']}, "
          f"conv {args.conv1}/{args.conv2}, batch {args.batch}, CPU rank {args.cpu_threads} threads)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cases": out, "speedup_gpu_cpu_over_gpu": ratio, "args": vars(args)}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=["gpu", "gpu+cpu"])
    p.add_argument("--all", action="store_true")
    p.add_argument("--conv1", type=int, default=500)
    p.add_argument("--conv2", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=14)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", default=os.path.join(HERE, "results", "conv_mp_gpu.json"), help="JSON to write")
    args = p.parse_args()
    if args.all:
        run_all(args)
    else:
        case_main(args)


if __name__ == "__main__":
    main()
