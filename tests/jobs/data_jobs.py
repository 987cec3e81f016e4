"""Models and datasets that tests of the data path ship with their jobs (run.files)."""
import torch
from torch import nn


def pool_linear(input_shape, num_classes):
    """A model whose cost does not grow with the image: average-pool to 4x4, then linear."""
    c = input_shape[0]
    return nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(c * 16, num_classes))


class Blobs(torch.utils.data.Dataset):
    """A learnable map-style dataset: class k (< 4) is a 1x8x8 image bright in quadrant k,
    plus noise drawn from torch's global generator (the loader seeds it per item)."""

    def __init__(self, n=600, classes=4, split="train"):
        self.n = n if split == "train" else n // 4
        self.num_classes = classes
        self.offset = 0 if split == "train" else 10 ** 6

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = (i + self.offset) % self.num_classes
        x = 0.5 * torch.randn(1, 8, 8)
        x[0, 4 * (k // 2):4 * (k // 2) + 4, 4 * (k % 2):4 * (k % 2) + 4] += 2.0
        return x, k


def blobs(n=600, classes=4, split="train"):
    return Blobs(n, classes, split)
