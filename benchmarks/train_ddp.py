"""Training throughput: our AllReduceStrategy vs torch DDP (gloo), same model and data.

    python benchmarks/train_ddp.py [--quick] [--ranks 2] [--models resnet,mlp]
                                   [--overlap poll,thread,none]

starts itself on RANKS ranks joined as an application's containers join
(common.relaunch); every rank uses 1 torch thread. For each
model (built by training.models.build_model, seed 0) both contenders train on the
same in-memory random batches (global batch --batch, split equally):

    ours-<overlap>  training.strategies.allreduce.AllReduceStrategy (defaults.yaml
                    bucket_mb / ring_threshold_kb), one per overlap mode asked for;
    ddp             torch.nn.parallel.DistributedDataParallel over a gloo process
                    group (file:// store) in the same processes, --ddp-bucket-mb buckets
                    (its default 25), gradient_as_bucket_view, SGD with the same lr and
                    momentum.

On one host ours sums through shared memory from 16 KiB up, a path DDP/gloo does not
have: its ratios are one host's. `--no-shm` times ours on the path ranks on different
hosts take (MPI point to point), as a multi-host job would.

Default models: resnet (ResNet-20, 0.27M parameters, compute-heavy) and mlp (two
4096-unit layers, 29M parameters = 116 MB of gradients, communication-heavy), both on
3x32x32 inputs. Rounds interleave the
contenders; a round is `--steps` steps timed between barriers; samples/s is the
median over rounds. Prints a table and writes
benchmarks/results/train_ddp.json (or --out).
"""
import argparse
import os
import sys
import tempfile
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INPUT_SHAPE = (3, 32, 32)
NUM_CLASSES = 10


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--models", default="resnet,mlp", help="comma-separated build_model names")
    p.add_argument("--overlap", default="poll", help="our overlap modes to time: poll,thread,none")
    p.add_argument("--batch", type=int, default=64, help="global batch (rows)")
    p.add_argument("--steps", type=int, default=None, help="steps per round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--no-shm", action="store_true",
                   help="ours without its shared-memory sum (training.strategy.shared_memory: false): the "
                        "path ranks on different hosts take; DDP/gloo has no such path")
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0,
                   help="DDP's bucket_cap_mb (its default 25; ours uses defaults.yaml's bucket_mb)")
    common.add_out(p, "train_ddp")
    return p.parse_args(argv)



def make_model(name):
    import torch

    from training.models import build_model
    torch.manual_seed(0)
    return build_model(name, INPUT_SHAPE, NUM_CLASSES, {})


def make_context(comm, shared_memory=True):
    """The RunContext and training section of a job of 1-vcore ranks with defaults.yaml's
    allreduce settings (RunContext.offline over conf.offline_job)."""
    import conf
    from training.context import RunContext
    job = conf.offline_job([1.0] * comm.Get_size(), name="bench", strategy="allreduce")
    strategy = job.training.strategy.model_copy(update={"shared_memory": shared_memory})
    job = job.model_copy(update={"training": job.training.model_copy(update={"strategy": strategy})})
    return RunContext.offline(comm, job, "bench"), job.training


class Ours:
    def __init__(self, name, ctx, spec, overlap):
        from training.strategies.allreduce.strategy import AllReduceStrategy
        import torch
        self.s = AllReduceStrategy(ctx, spec)
        self.s.overlap = overlap
        self.s.setup(make_model(name), lambda p: torch.optim.SGD(p, lr=spec.lr, momentum=spec.momentum))
        self.comm_s = 0.0

    def step(self, x, y):
        st = self.s.train_step(x, y)
        self.comm_s += st.comm_s

    def close(self):
        self.s.close()


class DDP:
    def __init__(self, name, ctx, spec, bucket_mb=25.0):
        import torch
        from torch.nn.parallel import DistributedDataParallel
        # its best settings here: gradients as views of its buckets (no copy into them)
        self.model = DistributedDataParallel(make_model(name), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=spec.lr, momentum=spec.momentum)
        self.comm_s = float("nan")

    def step(self, x, y):
        import torch.nn.functional as F
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        loss.item()

    def close(self):
        pass


def bench(args, comm):
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    torch.set_num_threads(1)
    rank, n = comm.Get_rank(), comm.Get_size()
    path = comm.bcast(tempfile.mktemp(prefix="gloo-store-") if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    ctx, spec = make_context(comm, shared_memory=not args.no_shm)
    steps = args.steps or (3 if args.quick else 8)
    rounds = args.rounds or (3 if args.quick else 5)
    per_rank = args.batch // n
    batches = common.random_batches(args.batch, INPUT_SHAPE, NUM_CLASSES, seed=1234)     # 16, cycled (not 4)
    batches = [(x[rank * per_rank:(rank + 1) * per_rank].contiguous(),
                y[rank * per_rank:(rank + 1) * per_rank].contiguous()) for x, y in batches]
    rows = []
    for name in args.models.split(","):
        contenders = {f"ours-{o}": Ours(name, ctx, spec, o) for o in args.overlap.split(",")}
        contenders["ddp"] = DDP(name, ctx, spec, args.ddp_bucket_mb)
        params = sum(p.numel() for p in make_model(name).parameters())
        names = list(contenders)
        for c in contenders.values():            # warm up: first-touch, allocator, connections
            for x, y in batches[:2]:
                c.step(x, y)
            c.comm_s = 0.0 if c.comm_s == c.comm_s else c.comm_s
        rates = {k: [] for k in names}
        for rnd in range(rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for k in order:
                c = contenders[k]
                comm.Barrier()
                t0 = time.perf_counter()
                for i in range(steps):
                    c.step(*batches[i % len(batches)])
                comm.Barrier()
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                rates[k].append(args.batch * steps / dt)
        row = {"model": name, "params": params, "grad_MB": params * 4 / 1e6, "batch": args.batch,
               "steps_per_round": steps, "rounds": rounds}
        for k in names:
            row[f"{k}_samples_per_s"] = float(np.median(rates[k]))
            if k.startswith("ours"):
                total_steps = steps * rounds
                row[f"{k}_comm_ms_per_step"] = 1e3 * contenders[k].comm_s / total_steps
        for k in names:
            if k != "ddp":
                row[f"{k}_vs_ddp"] = row[f"{k}_samples_per_s"] / row["ddp_samples_per_s"]
        rows.append(row)
        if rank == 0:
            print_row(row, names, header=len(rows) == 1)
        for c in contenders.values():
            c.close()
    dist.destroy_process_group()
    return rows, {"ranks": n, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                  "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
                  "bucket_mb": spec.strategy.bucket_mb, "shared_memory": spec.strategy.shared_memory,
                  "ddp_bucket_mb": args.ddp_bucket_mb, "ddp_gradient_as_bucket_view": True,
                  "ring_threshold_kb": spec.strategy.ring_threshold_kb}


def print_row(r, names, header):
    if header:
        print(f"{'model':>8} {'params':>8} | " + " | ".join(f"{k + ' samples/s':>22}" for k in names)
              + " | ours/ddp")
    cells = []
    for k in names:
        extra = f" (comm {r[f'{k}_comm_ms_per_step']:.1f} ms)" if f"{k}_comm_ms_per_step" in r else ""
        cells.append(f"{r[f'{k}_samples_per_s']:>8.1f}{extra:>14}")
    ratios = " ".join(f"{r[f'{k}_vs_ddp']:.2f}x" for k in names if k != "ddp")
    print(f"{r['model']:>8} {r['params'] / 1e6:>7.2f}M | " + " | ".join(cells) + f" | {ratios}", flush=True)



def main(argv=None):
    return common.mpi_main(__file__, argv, parse_args, bench)


if __name__ == "__main__":
    sys.exit(main())
