"""An ordinary torchrun-style DistributedDataParallel script, written as the PyTorch
tutorials write one (env:// rendezvous, gloo, DistributedSampler, a snapshot to resume
from, as in "Fault-tolerant Distributed Training with torchrun"). Nothing in it knows
about yarnapp but where its snapshot goes: a directory every rank and restart sees,
$YARNAPP_CHECKPOINT_URI (as a torchrun user gives --snapshot_path shared storage on many
nodes); the tests run it unmodified through `yarnapp submit`.

    python ddp_train.py --out DIR [--epochs N] [--pause SECONDS] [--backend nccl]

With --backend nccl it is the GPU form of the same tutorial: torch.cuda.set_device(LOCAL_RANK),
the model and batches on that device, DDP(device_ids=[LOCAL_RANK]).

Writes $YARNAPP_CHECKPOINT_URI/snapshot.pt (DIR/snapshot.pt outside yarnapp) after every
epoch (rank 0), and at the end DIR/rank<R>.pt (every
rank's final weights) and DIR/rank<R>.json (its environment and where it started).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after every step")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(384, 20), torch.randint(0, 4, (384,)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    model = DDP(net, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    snapshot = os.path.join(os.environ.get("YARNAPP_CHECKPOINT_URI", args.out), "snapshot.pt")
    start = 0
    if os.path.exists(snapshot):
        snap = torch.load(snapshot, map_location=device)
        model.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        start = snap["epochs_run"]
        print(f"rank {rank}: resuming from the snapshot at epoch {start}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            time.sleep(args.pause)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "epochs_run": epoch + 1}, snapshot + ".tmp")
            os.replace(snapshot + ".tmp", snapshot)
        dist.barrier()
        print(f"rank {rank}: epoch {epoch} done", flush=True)

    torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, os.path.join(args.out, f"rank{rank}.pt"))
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
            "CUDA_VISIBLE_DEVICES")
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "started_at_epoch": start, "world": world,
                   "local_rank": local_rank, "device": str(next(model.parameters()).device)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
