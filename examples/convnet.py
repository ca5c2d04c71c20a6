"""A small CNN for CIFAR-sized images, for ``autopipe plan examples/convnet.py``.

``model`` and ``sample`` are functions here: autopipe calls each once, with no arguments.
"""

import torch
from torch import nn


def model() -> nn.Sequential:
    """The network, built on demand."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.BatchNorm2d(128),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def sample() -> torch.Tensor:
    """One mini-batch of 32 RGB 32x32 images."""
    return torch.randn(32, 3, 32, 32)
