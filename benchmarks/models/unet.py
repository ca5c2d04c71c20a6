"""U-Net: four encoder levels whose outputs skip to the matching decoder level.

Inputs are 1-channel 64x64 images in batches of 4; widths start at 8 and double per level.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

BATCH = 4
SIZE = 64
WIDTH = 8
LEVELS = 4


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


class UNet(nn.Module):
    def __init__(self, channels: int = 1, width: int = WIDTH, levels: int = LEVELS) -> None:
        super().__init__()
        sizes = [width * 2**i for i in range(levels)]
        self.down = nn.ModuleList(
            DoubleConv(cin, cout) for cin, cout in zip([channels, *sizes[:-1]], sizes)
        )
        self.pool = nn.MaxPool2d(2)
        self.bottom = DoubleConv(sizes[-1], 2 * sizes[-1])
        self.ups = nn.ModuleList(nn.ConvTranspose2d(2 * s, s, 2, stride=2) for s in reversed(sizes))
        self.up = nn.ModuleList(DoubleConv(2 * s, s) for s in reversed(sizes))
        self.head = nn.Conv2d(sizes[0], 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, block, skip in zip(self.ups, self.up, reversed(skips)):
            x = block(torch.cat([skip, up(x)], dim=1))
        return self.head(x)


def model() -> nn.Module:
    torch.manual_seed(0)
    return UNet()


def sample() -> Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 1, SIZE, SIZE, generator=generator)
