"""AmoebaNet-D-like network: irregular multi-branch cells in a normal/reduction pattern.

Each cell takes the outputs of the two previous cells, brings both to its width with 1x1
convolutions, and builds four nodes, each the sum of two ops (separable convolutions,
pooling, identity) on earlier states; it outputs the concatenation of three of them. The
layout is N normal cells, a reduction cell, N normal, a reduction, N normal (N = 2), on
32x32 images in batches of 8, 8 channels per node at first.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

BATCH = 8
SIZE = 32
CHANNELS = 8
NORMAL_PER_STAGE = 2
CLASSES = 10

# Per node: two (op, input state) pairs. States 0 and 1 are the cell inputs; node i is
# state i + 2. Ops on the inputs of a reduction cell have stride 2.
Genotype = tuple[tuple[tuple[str, int], tuple[str, int]], ...]
NORMAL: Genotype = (
    (("sep_conv_3", 1), ("identity", 0)),
    (("avg_pool", 0), ("sep_conv_5", 1)),
    (("identity", 1), ("avg_pool", 2)),
    (("sep_conv_3", 0), ("max_pool", 3)),
)
NORMAL_CONCAT = (2, 4, 5)
REDUCE: Genotype = (
    (("max_pool", 0), ("sep_conv_3", 1)),
    (("sep_conv_5", 0), ("avg_pool", 1)),
    (("identity", 2), ("sep_conv_3", 0)),
    (("avg_pool", 2), ("max_pool", 1)),
)
REDUCE_CONCAT = (3, 4, 5)


class ReLUConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


class SepConv(nn.Module):
    """ReLU, depthwise k x k, pointwise 1x1, batch norm."""

    def __init__(self, channels: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(
                channels,
                channels,
                kernel,
                stride=stride,
                padding=kernel // 2,
                groups=channels,
                bias=False,
            ),
            nn.Conv2d(channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def make_op(name: str, channels: int, stride: int) -> nn.Module:
    if name == "sep_conv_3":
        return SepConv(channels, 3, stride)
    if name == "sep_conv_5":
        return SepConv(channels, 5, stride)
    if name == "avg_pool":
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if name == "max_pool":
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if name == "identity":
        return nn.Identity() if stride == 1 else ReLUConvBN(channels, channels, stride)
    raise ValueError(f"unknown op {name!r}")


class Cell(nn.Module):
    def __init__(
        self,
        cin_prev_prev: int,
        cin_prev: int,
        channels: int,
        reduction: bool,
        after_reduction: bool,
    ) -> None:
        super().__init__()
        # After a reduction the older input has twice the resolution: halve it here.
        self.pre0 = ReLUConvBN(cin_prev_prev, channels, stride=2 if after_reduction else 1)
        self.pre1 = ReLUConvBN(cin_prev, channels)
        genotype = REDUCE if reduction else NORMAL
        self.concat = REDUCE_CONCAT if reduction else NORMAL_CONCAT
        self.inputs = [[index for _, index in node] for node in genotype]
        self.ops = nn.ModuleList(
            make_op(name, channels, 2 if reduction and index < 2 else 1)
            for node in genotype
            for name, index in node
        )
        self.out_channels = len(self.concat) * channels

    def forward(self, s0: Tensor, s1: Tensor) -> Tensor:
        states = [self.pre0(s0), self.pre1(s1)]
        for i, (a, b) in enumerate(self.inputs):
            states.append(self.ops[2 * i](states[a]) + self.ops[2 * i + 1](states[b]))
        return torch.cat([states[i] for i in self.concat], dim=1)


class AmoebaNet(nn.Module):
    def __init__(
        self,
        channels: int = CHANNELS,
        normal_per_stage: int = NORMAL_PER_STAGE,
        classes: int = CLASSES,
    ) -> None:
        super().__init__()
        stem = 2 * channels
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem, 3, padding=1, bias=False), nn.BatchNorm2d(stem)
        )
        kinds = ([False] * normal_per_stage + [True]) * 2 + [False] * normal_per_stage
        cells = []
        prev_prev, prev, width, after_reduction = stem, stem, channels, False
        for reduction in kinds:
            if reduction:
                width *= 2
            cell = Cell(prev_prev, prev, width, reduction, after_reduction)
            cells.append(cell)
            prev_prev, prev, after_reduction = prev, cell.out_channels, reduction
        self.cells = nn.ModuleList(cells)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, classes)

    def forward(self, x: Tensor) -> Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.fc(torch.flatten(self.pool(s1), 1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return AmoebaNet()


def sample() -> Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 3, SIZE, SIZE, generator=generator)
