"""The comparison's benchmark networks: LeNet-5 and VGG-11 for CIFAR-10 (3x32x32)."""
import torch.nn as nn


class LeNetCIFAR(nn.Module):
    """LeNet-5 for CIFAR-10 (LeCun et al. 1998, as in the Caffe/PyTorch CIFAR tutorials):
    conv1 5x5 3->6 -> relu -> maxpool 2 -> conv2 5x5 6->16 -> relu -> maxpool 2 -> flatten
    (400) -> fc1 120 -> relu -> fc2 84 -> relu -> fc3 10. 62k parameters."""
    input_shape = (3, 32, 32)

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1, self.relu1, self.pool1 = nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2)
        self.conv2, self.relu2, self.pool2 = nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1, self.relu3 = nn.Linear(16 * 5 * 5, 120), nn.ReLU()
        self.fc2, self.relu4 = nn.Linear(120, 84), nn.ReLU()
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.relu3(self.fc1(self.flatten(x)))
        return self.fc3(self.relu4(self.fc2(x)))


VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGGCIFAR(nn.Module):
    """VGG-11 (Simonyan & Zisserman 2015, configuration A) for CIFAR-10 without batch norm:
    3x3 convs (padding 1) of widths `cfg`, each followed by ReLU, "M" a 2x2 max pool; after
    the five pools the map is 512x1x1 -> flatten -> fc1 512 -> relu -> fc2 10. 9.5M
    parameters, 0.15 GMAC per image forward. `groups` > 1 makes every conv after the first
    a grouped one (ResNeXt-style cardinality: channel c reads only its group's inputs)."""
    input_shape = (3, 32, 32)

    def __init__(self, num_classes=10, cfg=VGG11, hidden=512, groups=1):
        super().__init__()
        layers, c = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1, groups=1 if c == 3 else groups), nn.ReLU()]
                c = v
        self.features = nn.Sequential(*layers)
        self.flatten = nn.Flatten()
        self.fc1, self.relu, self.fc2 = nn.Linear(c, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(self.flatten(self.features(x)))))


BENCHMARK_NETWORKS = {"lenet": LeNetCIFAR, "vgg11": VGGCIFAR}
