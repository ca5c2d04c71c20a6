"""Profiles of models on the meta device: counted as built for real, measured layer by layer."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import profiler.measure_pass
from profiler.materialize import has_meta
from profiler.measure import profile_layers
from profiler.profile import Profile
from tests.support.counted import byte_differences
from tests.support.meta_models import ItemGate, MaskedPick

COUNTS = (
    "flops",
    "backward_flops",
    "backward_input_flops",
    "traffic",
    "backward_traffic",
)
SIZES = [2, 4]


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _layers() -> list[nn.Module]:
    return [
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        *(_Block(16) for _ in range(3)),
        nn.LayerNorm(16),
        nn.Linear(16, 4),
    ]


def _build(factory: Callable[[], list[nn.Module]], meta: bool) -> list[nn.Module]:
    if meta:
        with torch.device("meta"):
            return factory()
    torch.manual_seed(0)
    return factory()


def _counts(profile: Profile) -> dict[str, Any]:
    return {
        f"{layer.name}.{field}": getattr(layer, field)
        for layer in profile.layers
        for field in COUNTS
    }


def test_meta_model_counts_as_the_real_one() -> None:
    sample = torch.randn(4, 8)
    meta = profile_layers(_build(_layers, True), sample, batch_sizes=SIZES, measure=False)
    real = profile_layers(_build(_layers, False), sample, batch_sizes=SIZES, measure=False)
    assert meta.meta["meta_device"] and "meta_device" not in real.meta
    assert byte_differences(meta, real) == {}
    assert _counts(meta) == _counts(real)
    assert all(layer.traffic and layer.traffic[0] > 0 for layer in meta.layers)
    assert meta.layers[0].flops == [2 * n * 8 * 16 for n in SIZES]


def test_meta_model_is_measured_one_materialized_layer_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replicas: list[weakref.ref[nn.Module]] = []
    alive_at_each: list[int] = []
    original = profiler.measure_pass._replica

    def replica(layer: nn.Module, device: torch.device) -> nn.Module:
        gc.collect()
        alive_at_each.append(sum(ref() is not None for ref in replicas))
        made = original(layer, device)
        assert not has_meta(made)
        replicas.append(weakref.ref(made))
        return made

    monkeypatch.setattr(profiler.measure_pass, "_replica", replica)
    layers = _build(_layers, True)
    sample = torch.randn(4, 8)
    measured = profile_layers(layers, sample, batch_sizes=SIZES, warmup=0, repeats=1)
    # One replica per distinct layer (the three blocks are one), none alive with another.
    assert len(replicas) == 5
    assert alive_at_each == [0] * 5
    assert all(has_meta(layer) for layer in layers)
    monkeypatch.setattr(profiler.measure_pass, "_replica", original)
    real = profile_layers(_build(_layers, False), sample, batch_sizes=SIZES, warmup=0, repeats=1)
    assert byte_differences(measured, real) == {}
    assert _counts(measured) == _counts(real)
    assert all(t > 0 for layer in measured.layers for t in layer.forward)


@pytest.mark.parametrize("reader", [ItemGate, MaskedPick])
@pytest.mark.parametrize("measure", [False, True])
def test_a_layer_reading_values_on_meta_is_named(reader: type[nn.Module], measure: bool) -> None:
    with torch.device("meta"):
        layers = [nn.Linear(4, 4), reader()]
    message = rf"cannot count layer 1 \({reader.__name__}\) without tensor values"
    with pytest.raises(ValueError, match=message):
        profile_layers(layers, torch.randn(4, 4), batch_sizes=[2], measure=measure)


def test_a_real_layer_reading_values_is_measured_uncounted() -> None:
    torch.manual_seed(0)
    profile = profile_layers(
        [nn.Linear(4, 4), ItemGate()], torch.randn(4, 4), batch_sizes=[2], warmup=0, repeats=1
    )
    assert "ItemGate" in profile.meta["uncounted"]
    assert profile.layers[1].saved[0] > 0 and profile.layers[1].flops is None
