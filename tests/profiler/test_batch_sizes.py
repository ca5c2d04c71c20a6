"""Tests of the micro-batch sizes layers are measured at (profiler.batch_sizes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from profiler import profile_layers
from profiler.batch_sizes import (
    batch_refusal,
    default_batch_sizes,
    doubling_batch_sizes,
    smallest_batch,
)
from tests.support.cnn_models import squeeze_cnn

FAST = {"warmup": 0, "repeats": 1}


def _squeeze_layers() -> list[nn.Module]:
    """The CNN as layers, its 1x1 BatchNorm alone: a batch of one reaches it as 1x1x16."""
    model = squeeze_cnn()
    return [model.stem, model.body, model.pool, model.squeeze, nn.Flatten(), model.head]


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1, 2]
    assert default_batch_sizes(2) == [1, 2]
    assert default_batch_sizes(7) == [3, 7]
    # Never below the smallest size: the micro-batch and twice it instead of the half.
    assert default_batch_sizes(1, smallest=2) == [2, 4]
    assert default_batch_sizes(2, smallest=2) == [2, 4]
    assert default_batch_sizes(3, smallest=2) == [3, 6]
    assert default_batch_sizes(4, smallest=2) == [2, 4]
    assert default_batch_sizes(7, smallest=2) == [3, 7]


def test_doubling_batch_sizes_span_the_batch() -> None:
    assert doubling_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert doubling_batch_sizes(12, smallest=2) == [2, 4, 8, 12]
    assert doubling_batch_sizes(1, smallest=2) == [1]


def test_a_training_batch_norm_raises_the_smallest_size() -> None:
    norm = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.BatchNorm1d(2)))
    assert smallest_batch([nn.Linear(2, 2), norm]) == 2
    assert smallest_batch([nn.Linear(2, 2), nn.LayerNorm(2)]) == 1
    assert smallest_batch([norm.eval()]) == 1  # running statistics: any batch works


def test_batch_refusal_recognizes_batch_norm_only() -> None:
    x = (torch.randn(1, 4, 1, 1),)
    with pytest.raises(ValueError) as raised:
        nn.BatchNorm2d(4)(*x)
    message = batch_refusal(raised.value, "layer 3 (BatchNorm2d)", x)
    assert message is not None
    assert message.startswith("layer 3 (BatchNorm2d) refuses a micro-batch of 1: ")
    assert "at least 2 samples" in message
    assert batch_refusal(RuntimeError("shape mismatch"), "layer 3 (Linear)", x) is None


def test_profile_layers_measures_a_squeeze_cnn_by_default() -> None:
    """A micro-batch of 2 was measured at [1, 2], which the 1x1 BatchNorm refuses."""
    profile = profile_layers(_squeeze_layers(), torch.randn(8, 3, 16, 16), chunks=4, **FAST)
    assert profile.batch_sizes == [2, 4]
    assert all(len(layer.forward) == 2 for layer in profile.layers)


@pytest.mark.parametrize("measure", [True, False])
def test_a_refused_size_names_the_layer_and_the_fix(measure: bool) -> None:
    layers = _squeeze_layers()
    with pytest.raises(ValueError) as raised:
        profile_layers(
            layers, torch.randn(8, 3, 16, 16), batch_sizes=[1, 2], measure=measure, **FAST
        )
    message = str(raised.value)
    assert message.startswith("layer 3 (Sequential) refuses a micro-batch of 1: ")
    assert "at least 2 samples" in message
    assert "real weights" not in message  # the counted case: real weights fail alike


def test_a_refused_size_on_the_meta_device() -> None:
    with torch.device("meta"):
        layers = _squeeze_layers()
    with pytest.raises(ValueError, match=r"layer 3 \(Sequential\) refuses a micro-batch of 1"):
        profile_layers(layers, torch.randn(8, 3, 16, 16), batch_sizes=[1, 2], measure=False)


def test_a_micro_batch_the_layers_refuse_is_refused_before_measuring() -> None:
    """Measured at [2, 4], a micro-batch of one would be planned for, and fail in training."""
    with pytest.raises(ValueError, match=r"layer 3 \(Sequential\) refuses a micro-batch of 1"):
        profile_layers(_squeeze_layers(), torch.randn(8, 3, 16, 16), chunks=8, **FAST)
    # A BatchNorm over a 4x4 map trains on one sample: the micro-batch of one is planned.
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)]
    profile = profile_layers(layers, torch.randn(4, 3, 4, 4), chunks=4, **FAST)
    assert profile.batch_sizes == [2, 4] and profile.micro_batch() == 1
