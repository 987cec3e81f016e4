"""A user's own training loop on yarnapp's public API (training.dist), as a user would
write it: a map-style dataset, a DataLoader over yarnapp's ShareSampler, a
DistributedOptimizer. The tests run it as run.function `user_loop:main` (shipped with
run.files) and compare its weights with one process training on the global batch.

Environment (set through the job's groups[].env): OUT (where every rank writes its
final weights), SHARES (equal | vcores), STEPS, BATCH, CLIP (clip the gradient's norm
to this between backward and step: DDP's way on odd steps, Horovod's synchronize() and
skip_synchronize() on even ones), FINETUNE (1: the first conv frozen when the optimizer
is wrapped and unfrozen at step 5, the second frozen from step 12 on: `finetune`;
apart: rank 1 alone freezes the first conv at step 3), BROADCAST (every, the default;
rank0, rank0_late, none: the ranks start from weights of their own, and rank 0 alone
broadcasts them, before or after the optimizer is wrapped, or none does; rank0_object: rank 0
alone broadcasts an object after step 2, every rank after step 4).
"""
import os

import torch
import torch.nn.functional as F

import training.dist as yd

SEED = 7
ROWS = 480


def dataset():
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(ROWS, 3, 12, 12, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, :6].mean(dim=(1, 2)) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(16 * 6 * 6, 4))


def finetune(net, step):
    """Fine-tuning's schedule: the first conv trains from step 5 on, the second until step 12."""
    for p in net[0].parameters():
        p.requires_grad_(step >= 5)
    for p in net[3].parameters():
        p.requires_grad_(step < 12)


def optimizer(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def main(ctx):
    yd.init(ctx)
    steps, batch = int(os.environ.get("STEPS", 20)), int(os.environ.get("BATCH", 48))
    data = dataset()
    sampler = yd.ShareSampler(data, batch_size=batch, shares=os.environ.get("SHARES", "vcores"), seed=SEED)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    dev = yd.device()                   # cuda:0 in a container with a GPU, else the CPU
    net = model().to(dev)
    broadcast = os.environ.get("BROADCAST", "every")
    if broadcast in ("rank0", "rank0_late", "none"):    # each rank its own weights, broadcast on rank 0 alone or none
        with torch.no_grad():
            net[0].weight.add_(yd.rank())
    if broadcast in ("every", "rank0_object") or (broadcast == "rank0" and yd.rank() == 0):
        yd.broadcast_parameters(net.state_dict(), root_rank=0)
    tune = os.environ.get("FINETUNE") == "1"
    if tune:
        finetune(net, 0)
    opt = yd.DistributedOptimizer(optimizer(net), model=net, weight=sampler.weight)
    if broadcast == "rank0_late" and yd.rank() == 0:      # Horovod's order, on rank 0 alone
        yd.broadcast_parameters(net.state_dict(), root_rank=0)
    step = 0
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(dev), y.to(dev)
            if tune:
                finetune(net, step)
            if os.environ.get("FINETUNE") == "apart" and yd.rank() == 1 and step == 3:
                net[0].requires_grad_(False)
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            clip = float(os.environ.get("CLIP", 0))
            if clip and step % 2:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)     # the world's gradient, as with DDP
                opt.step()
            elif clip:
                opt.synchronize()                                           # as with Horovod
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            step += 1
            if broadcast == "rank0_object" and (step == 2 and yd.rank() == 0 or step == 4):
                # a rank-0-only broadcast of a few bytes returns at once; the others' next takes it
                got = yd.broadcast_object({"best": step}, root_rank=0)
                assert got == {"best": step}, f"rank {yd.rank()} received {got} at step {step}"
            yd.report(step=step, loss=float(loss), rows=len(y))
            if step == steps:
                torch.save({k: v.cpu() for k, v in net.state_dict().items()},
                           os.path.join(os.environ["OUT"], f"rank{yd.rank()}.pt"))
                return


def reference(steps=20, batch=48, clip=0.0, tune=False):
    """One process, the whole global batch every step, the same order: the weights the
    distributed run must end with."""
    data = dataset()
    net = model()
    opt = optimizer(net)
    step = 0
    for epoch in range(100):
        order = yd.permutation(len(data), SEED, epoch)
        for s in range(len(data) // batch):
            x, y = data[order[s * batch:(s + 1) * batch]]
            if tune:
                finetune(net, step)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            step += 1
            if step == steps:
                return net.state_dict()
