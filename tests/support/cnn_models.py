"""A small CNN whose last BatchNorm sees a 1x1 feature map, as torchvision's ResNets,
MobileNets, EfficientNets and RegNets do (their squeeze-excite blocks and heads): in
training it refuses a batch of one ("Expected more than 1 value per channel")."""

from __future__ import annotations

from pathlib import Path

from torch import nn

# A model file for ``autopipe plan``, as a new user would write one.
SQUEEZE_CNN = """import torch
from torch import nn


class SqueezeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.squeeze = nn.Sequential(nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.squeeze(self.pool(self.body(self.stem(x))))
        return self.head(torch.flatten(x, 1))


model = SqueezeNet()
sample = torch.randn(8, 3, 16, 16)
"""


def write_squeeze_cnn(folder: Path) -> Path:
    """The model file, written in ``folder``."""
    path = folder / "squeeze_cnn.py"
    path.write_text(SQUEEZE_CNN)
    return path


def squeeze_cnn() -> nn.Module:
    """The model of the model file, in training mode."""
    scope: dict[str, object] = {}
    exec(compile(SQUEEZE_CNN, "squeeze_cnn.py", "exec"), scope)
    model = scope["model"]
    assert isinstance(model, nn.Module)
    return model
