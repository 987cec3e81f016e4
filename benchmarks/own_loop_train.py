"""The training loop of benchmarks/own_loop.py, written twice as a user would write it:

    --api ours   on yarnapp's public API (training.dist): ShareSampler with --shares,
                 DistributedOptimizer (bucketed ring all-reduce, polite waits)
    --api ddp    plain torch: init_process_group("gloo") from the env:// variables the
                 launcher sets, DistributedSampler (equal shares: all torch offers),
                 DistributedDataParallel
    --api plain  one process, no torch.distributed at all (a shuffled DataLoader): what a
                 rank alone is measured against (a rank of ours alone sums nothing, while
                 DDP runs its all-reduce over one rank)

Both train the example's model (training.models "resnet", ResNet-20) on the same
CIFAR-shaped rows held in memory, global batch --batch, SGD with momentum; rank 0
writes {samples_per_s, steps, ...} of the steps after --warmup to --out.
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--api", choices=("ours", "ddp", "plain"), required=True)
    p.add_argument("--shares", default="vcores")
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)
    return p.parse_args()


def data(rows=4096):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(rows, 3, 32, 32, generator=g),
                                          torch.randint(0, 10, (rows,), generator=g))


def model():
    from training.models import build_model
    torch.manual_seed(0)
    return build_model("resnet", (3, 32, 32), 10)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(loader_epochs, net, opt, warmup, steps, rank, batch, device):
    done, t0 = 0, None
    for batches in loader_epochs():
        for x, y in batches:
            if done == warmup:
                sync(device)
                t0 = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            done += 1
            if done == warmup + steps:
                sync(device)
                return steps * batch / (time.perf_counter() - t0)


def main():
    args = parse_args()
    dataset = data()
    if args.api == "ours":
        import training.dist as yd
        ctx = yd.init()
        rank, device = ctx.rank, yd.device()
        sampler = yd.ShareSampler(dataset, batch_size=args.batch, shares=args.shares, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        net = model().to(device)
        yd.broadcast_parameters(net.state_dict())
        opt = yd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                      model=net, weight=sampler.weight)

        def epochs():
            for e in range(1000):
                sampler.set_epoch(e)
                yield loader
    elif args.api == "plain":
        rank = 0
        gpu = torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "") != ""
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        g = torch.Generator().manual_seed(0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, generator=g,
                                             drop_last=True)
        net = model().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

        def epochs():
            while True:
                yield loader
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler
        gpu = torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "") != ""
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")   # its container's own GPU
        dist.init_process_group("nccl" if gpu else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(dataset, batch_size=args.batch // world, sampler=sampler, drop_last=True)
        net = DDP(model().to(device), device_ids=[0] if gpu else None)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

        def epochs():
            for e in range(1000):
                sampler.set_epoch(e)
                yield loader
    rate = train(epochs, net, opt, args.warmup, args.steps, rank, args.batch, device)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"samples_per_s": rate, "steps": args.steps, "batch": args.batch, "api": args.api,
                       "shares": args.shares if args.api == "ours" else "equal",
                       "threads": torch.get_num_threads(), "world": int(os.environ.get("WORLD_SIZE", 1)),
                       "device": device.type}, f)


if __name__ == "__main__":
    main()
