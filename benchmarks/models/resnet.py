"""ResNet-101-style CNN: bottleneck blocks in stages of [3, 4, 23, 3], tiny widths.

Inputs are 32x32 images in batches of 8; the stem is a 3x3 convolution (CIFAR style) and
the stage widths are 8, 16, 32 and 64 bottleneck channels with expansion 4.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

LAYERS = (3, 4, 23, 3)
WIDTHS = (8, 16, 32, 64)
EXPANSION = 4
BATCH = 8
SIZE = 32
CLASSES = 10


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand, with a (projected when needed) residual."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * EXPANSION
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(
        self,
        layers: tuple[int, ...] = LAYERS,
        widths: tuple[int, ...] = WIDTHS,
        classes: int = CLASSES,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        cin = widths[0]
        stages = []
        for i, (count, width) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(count):
                blocks.append(Bottleneck(cin, width, stride=2 if i > 0 and j == 0 else 1))
                cin = width * EXPANSION
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return ResNet()


def sample() -> Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 3, SIZE, SIZE, generator=generator)
