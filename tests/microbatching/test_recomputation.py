"""is_checkpointing / is_recomputing: true in the checkpointed forward / its re-computation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopipe
from autopipe.distributed.stage import StageModule


class Flags(nn.Module):
    """Records (is_checkpointing, is_recomputing) at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((autopipe.is_checkpointing(), autopipe.is_recomputing()))
        return self.linear(x)


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        ("always", [(True, False), (True, False), (False, True), (False, True)]),
        ("except_last", [(True, False), (False, False), (False, True)]),
        ("never", [(False, False), (False, False)]),
    ],
)
def test_gpipe_runner(checkpoint, expected):
    flags = Flags()
    pipe = autopipe.GPipe(
        nn.Sequential(flags), [1], devices=["cpu"], chunks=2, checkpoint=checkpoint
    )
    pipe(torch.rand(4, 2)).sum().backward()
    assert flags.seen == expected
    assert not autopipe.is_checkpointing() and not autopipe.is_recomputing()


def test_distributed_stage():
    flags = Flags()
    stage = StageModule([("0", flags)], checkpoint="always", chunks=1)
    stage(torch.rand(4, 2, requires_grad=True)).sum().backward()
    assert flags.seen == [(True, False), (False, True)]
