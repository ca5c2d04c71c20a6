"""GPipe as torchgpipe users call it: the refusals they get, and what is legal."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from autopipe import GPipe


@pytest.mark.parametrize("checkpoint", [None, 1, object()])
def test_non_string_checkpoint_is_refused(checkpoint):
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last'"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], checkpoint=checkpoint)


def test_missing_balance_points_to_the_balancers():
    with pytest.raises(ValueError, match="autopipe.balance.balance_by_time"):
        GPipe(nn.Sequential(nn.Linear(1, 1)))


@pytest.mark.parametrize("batch", [7, 2])
def test_indivisible_or_small_batches_train_without_warning(batch):
    model = GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output = model(torch.rand(batch, 1))
    assert output.shape == (batch, 1)
