"""A user's model factory for the built-in runner (training.model: user_model:make_net),
with nested options, shipped with run.files; and a function that uses the
torch.distributed process group the launcher prepares (ctx.init_process_group)."""
import torch
from torch import nn


def make_net(num_classes, input_shape, hidden=32, block=None, norm=False):
    block = block or {"kind": "relu", "dropout": 0.0}
    act = {"relu": nn.ReLU, "tanh": nn.Tanh}[block["kind"]]
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, hidden, 3, padding=1), nn.BatchNorm2d(hidden) if norm else nn.Identity(), act(),
                         nn.Dropout(block["dropout"]), nn.Flatten(), nn.Linear(hidden * h * w, num_classes))


def make_bn_net(num_classes, input_shape, width=8):
    """BatchNorm and a grouped conv: what the hypergraph strategy cannot place, and a conv
    conv_model_parallel cannot split."""
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1, groups=4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(width * h * w, num_classes))


class TinySet(torch.utils.data.Dataset):
    """A dataset of the user's own (its images are not read at submit): 64 rows of 1 x 8 x 8
    noise in 4 classes."""

    def __init__(self, split="train"):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.x, self.y = torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 4, (64,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def process_group(ctx):
    import torch.distributed as dist
    ctx.init_process_group()
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.final(sum=float(t), backend=dist.get_backend(), world=dist.get_world_size())
    dist.destroy_process_group()


class _WholeConv(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        c, h, w = input_shape
        self.conv1, self.conv2 = nn.Conv2d(c, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * h * w, num_classes)

    def forward(self, x):
        # a model that reads its layers' own attributes (where torch.fx cannot trace it: the
        # check runs in every call, not once at the trace)
        if float(x.detach().sum()) > -1e30 and type(self.conv2) is not nn.Conv2d:
            raise RuntimeError(f"conv2 is a {type(self.conv2).__name__}: this model needs nn.Conv2d layers")
        return self.fc(self.conv2(self.conv1(x).relu()).relu().flatten(1))


def make_whole_conv_net(num_classes, input_shape):
    """A model conv_model_parallel cannot run (it replaces the convs), the others can."""
    return _WholeConv(num_classes, input_shape)
