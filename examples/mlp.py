"""An MLP whose layers differ widely in cost, for ``autopipe plan examples/mlp.py``.

The wide layers sit in the first half, so an equal split of the layer count (``uniform``)
leaves the first stage with almost all of the work, while the optimal split cuts inside
the wide block. Profiles in a few seconds on a CPU.
"""

from collections import OrderedDict

import torch
from torch import nn

torch.manual_seed(0)

model = nn.Sequential(
    OrderedDict(
        [
            ("embed", nn.Linear(256, 2048)),
            ("act0", nn.GELU()),
            ("wide1", nn.Linear(2048, 2048)),
            ("act1", nn.GELU()),
            ("wide2", nn.Linear(2048, 2048)),
            ("act2", nn.GELU()),
            ("norm", nn.LayerNorm(2048)),
            ("down1", nn.Linear(2048, 512)),
            ("act3", nn.ReLU()),
            ("mid1", nn.Linear(512, 512)),
            ("act4", nn.ReLU()),
            ("down2", nn.Linear(512, 128)),
            ("act5", nn.ReLU()),
            ("mid2", nn.Linear(128, 128)),
            ("act6", nn.ReLU()),
            ("head", nn.Linear(128, 10)),
        ]
    )
)

# One mini-batch of 32 samples: the batch the pipeline is planned for.
sample = torch.randn(32, 256)
