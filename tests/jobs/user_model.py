"""A user's model factory for the built-in runner (training.model: user_model:make_net),
with nested options, shipped with run.files; and a function that uses the
torch.distributed process group the launcher prepares (ctx.init_process_group)."""
import torch
from torch import nn


def make_net(num_classes, input_shape, hidden=32, block=None):
    block = block or {"kind": "relu", "dropout": 0.0}
    act = {"relu": nn.ReLU, "tanh": nn.Tanh}[block["kind"]]
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, hidden, 3, padding=1), act(), nn.Dropout(block["dropout"]),
                         nn.Flatten(), nn.Linear(hidden * h * w, num_classes))


def make_bn_net(num_classes, input_shape, width=8):
    """BatchNorm and a grouped conv: what the hypergraph strategy cannot place, and a conv
    conv_model_parallel cannot split."""
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1, groups=4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(width * h * w, num_classes))


def process_group(ctx):
    import torch.distributed as dist
    ctx.init_process_group()
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.final(sum=float(t), backend=dist.get_backend(), world=dist.get_world_size())
    dist.destroy_process_group()
