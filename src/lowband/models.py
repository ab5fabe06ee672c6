"""Models registered by name, all for 1x28x28 inputs and 10 classes."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, hidden: tuple[int, ...] = (256, 128), num_classes: int = 10):
        super().__init__()
        dims = (28 * 28, *hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


class LeNet(nn.Module):
    """The classic Caffe/MXNet LeNet (conv20-pool-conv50-pool-fc500-fc10), 0.43M parameters.
    Its fully connected layer dominates the bytes, which makes it communication-heavy."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(50 * 4 * 4, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            # 1x1 projection (He et al. option B), as in PCNN's ResNet-20
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the shortcut first: in data-flow order the projection is the input-side layer of its
        # block, as in PCNN's layer list (the lazy update orders layers by first forward use)
        identity = self.shortcut(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet20(nn.Module):
    """CIFAR-style ResNet-20 (3 stages of 3 blocks, 16/32/64 channels), with a one-channel
    stem for 28x28 inputs (feature maps 28 -> 14 -> 7)."""

    def __init__(self, num_classes: int = 10, blocks_per_stage: int = 3, widths: tuple[int, int, int] = (16, 32, 64)):
        super().__init__()
        self.conv1 = nn.Conv2d(1, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, cin = [], widths[0]
        for stage, width in enumerate(widths):
            for b in range(blocks_per_stage):
                stride = 2 if stage > 0 and b == 0 else 1
                layers.append(BasicBlock(cin, width, stride))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "cnn": LeNet,
    "resnet20": ResNet20,
}


def make_model(name: str) -> nn.Module:
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}") from None
