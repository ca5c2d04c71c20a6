"""Tests of pooling identical layers' timings (profiler.pooling)."""

from __future__ import annotations

import torch
from torch import nn

from profiler import Profile, profile_model
from profiler.pooling import layer_signature, pool_identical
from profiler.profile import LayerProfile

FAST = {"warmup": 1, "repeats": 2}


def _layer(name: str, forward: list[float], backward: list[float]) -> LayerProfile:
    return LayerProfile(
        name=name,
        kind="Linear",
        forward=forward,
        backward=backward,
        saved=[10, 20],
        output=[4, 8],
        param_bytes=100,
        buffer_bytes=0,
    )


def test_groups_get_the_median_of_their_members() -> None:
    layers = [
        _layer("a", [1.0, 2.0], [3.0, 6.0]),
        _layer("b", [2.0, 4.0], [1.0, 2.0]),
        _layer("c", [9.0, 9.0], [9.0, 9.0]),
        _layer("d", [3.0, 3.0], [2.0, 4.0]),
    ]
    pooled, groups = pool_identical(layers, ["x", "x", "y", "x"])
    assert groups == [["a", "b", "d"]]
    for i in (0, 1, 3):
        assert pooled[i].forward == [2.0, 3.0]
        assert pooled[i].backward == [2.0, 4.0]
        assert pooled[i].name == layers[i].name  # everything else stays per layer
    assert pooled[2] == layers[2]


def test_signature_tells_shapes_modes_and_types_apart() -> None:
    x = [(torch.randn(4, 8),)]
    base = layer_signature(nn.Sequential(nn.Linear(8, 8), nn.GELU()), x)
    assert base == layer_signature(nn.Sequential(nn.Linear(8, 8), nn.GELU()), x)
    assert base != layer_signature(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), x)
    assert base != layer_signature(nn.Sequential(nn.Linear(8, 8, bias=False), nn.GELU()), x)
    assert base != layer_signature(nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval(), x)
    assert base != layer_signature(
        nn.Sequential(nn.Linear(8, 8), nn.GELU()), [(torch.randn(2, 8),)]
    )
    assert base != layer_signature(
        nn.Sequential(nn.Linear(8, 8), nn.GELU()).double(), [(torch.randn(4, 8),)]
    )


def test_profile_pools_repeated_blocks_only() -> None:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
    model = nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 2))
    profile = profile_model(model, torch.randn(8, 8), chunks=2, **FAST)
    assert profile.meta["pooled"] == [["1", "2", "3", "4"]]
    times = {(tuple(p.forward), tuple(p.backward)) for p in profile.layers[1:5]}
    assert len(times) == 1
    again = Profile.from_dict(profile.to_dict())
    assert again.meta["pooled"] == profile.meta["pooled"]
    assert [p.forward for p in again.layers] == [p.forward for p in profile.layers]


def test_pooling_can_be_turned_off() -> None:
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    profile = profile_model(model, torch.randn(8, 16), pool=False, **FAST)
    assert "pooled" not in profile.meta


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Shifted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) + x


def test_traced_units_pool_by_computation_not_by_names() -> None:
    x = [(torch.randn(4, 8),)]
    first = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), Shifted()))
    second = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), Shifted()))
    other = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), Twice()))
    assert layer_signature(first, x) == layer_signature(second, x)
    assert layer_signature(first, x) != layer_signature(other, x)
