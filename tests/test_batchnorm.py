"""Tests for deferred batch normalization."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autopipe.batchnorm import DeferredBatchNorm
from autopipe.checkpoint import _recomputing


def _pair(momentum: float | None, dims: int) -> tuple[nn.Module, DeferredBatchNorm]:
    torch.manual_seed(0)
    kind = nn.BatchNorm1d if dims == 2 else nn.BatchNorm2d
    plain = kind(3, momentum=momentum).double()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1, 1)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    assert isinstance(deferred, DeferredBatchNorm)
    return plain, deferred


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dims", [2, 4])
def test_statistics_match_full_batch(momentum: float | None, dims: int) -> None:
    plain, deferred = _pair(momentum, dims)
    for step in range(2):
        shape = (11, 3) if dims == 2 else (11, 3, 4, 5)
        x = torch.randn(*shape, dtype=torch.float64) * (step + 1) + step
        plain(x)
        outputs = [deferred(part) for part in x.tensor_split(4)]
        deferred.commit()
        # Each micro-batch is normalized with its own statistics.
        for part, out in zip(x.tensor_split(4), outputs):
            expected = nn.functional.batch_norm(
                part, None, None, deferred.weight, deferred.bias, training=True
            )
            torch.testing.assert_close(out, expected)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(deferred, name), getattr(plain, name), rtol=0, atol=1e-9)


def test_state_dict_keys_and_sharing() -> None:
    plain, deferred = _pair(0.1, 2)
    assert list(deferred.state_dict()) == list(plain.state_dict())
    bn = nn.BatchNorm1d(3)
    inner = nn.Sequential(bn)
    model = nn.Sequential(nn.Linear(2, 3), inner)
    converted = DeferredBatchNorm.convert(model)
    replaced = inner[0]
    assert converted is model and isinstance(replaced, DeferredBatchNorm)
    assert replaced.weight is bn.weight and replaced.running_mean is bn.running_mean


def test_no_tracking_in_eval_or_recompute_and_untracked_kept() -> None:
    _, deferred = _pair(0.1, 2)
    before = deferred.running_mean.clone()  # type: ignore[union-attr]
    with _recomputing():
        deferred(torch.randn(4, 3, dtype=torch.float64))
    deferred.commit()
    deferred.eval()
    deferred(torch.randn(4, 3, dtype=torch.float64))
    deferred.commit()
    assert torch.equal(deferred.running_mean, before)  # type: ignore[arg-type]
    assert int(deferred.num_batches_tracked) == 0  # type: ignore[arg-type]
    untracked = nn.BatchNorm1d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert(untracked) is untracked


def test_rejects_1d_input() -> None:
    _, deferred = _pair(0.1, 2)
    with pytest.raises(ValueError, match="2D"):
        deferred(torch.randn(3))
