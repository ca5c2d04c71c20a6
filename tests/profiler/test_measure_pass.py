"""Each distinct layer is measured once; its twins share its figures and get real inputs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import profiler.measure_pass
from profiler.layer import measure_layer
from profiler.measure import profile_layers
from profiler.profile import LayerProfile
from tests.support.counted import byte_differences, counted_and_measured

SIZES = [2, 4]


class _Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.linear(self.norm(x)))


def _model(blocks: int = 6) -> list[nn.Module]:
    torch.manual_seed(0)
    return [*(_Block() for _ in range(blocks)), nn.Linear(16, 3)]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Records each ``measure_layer`` call: the layer's label and its input shapes."""
    calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def spy(layer: nn.Module, inputs: tuple[Tensor, ...], *args: Any, **kwargs: Any) -> Any:
        calls.append((kwargs["label"], [tuple(t.shape) for t in inputs]))
        return measure_layer(layer, inputs, *args, **kwargs)

    monkeypatch.setattr(profiler.measure_pass, "measure_layer", spy)
    return calls


def _cost(layer: LayerProfile) -> LayerProfile:
    """The layer's figures without its name."""
    return replace(layer, name="")


@pytest.mark.parametrize("count", [True, False])
def test_identical_blocks_are_measured_once(monkeypatch: pytest.MonkeyPatch, count: bool) -> None:
    # With the count pass the signatures are known ahead; without, they are found on the way.
    calls = _spy(monkeypatch)
    profile = profile_layers(
        _model(), torch.randn(4, 16), batch_sizes=SIZES, warmup=0, repeats=1, count=count
    )
    assert [label for label, _ in calls] == [
        "layer 0 (_Block)",
        "layer 0 (_Block)",
        "layer 6 (Linear)",
        "layer 6 (Linear)",
    ]
    blocks = profile.layers[:6]
    # The first block's input comes from outside (nothing shared with a previous layer).
    assert blocks[0].shared == [0, 0]
    assert all(_cost(b) == _cost(blocks[1]) for b in blocks[1:])
    assert all(replace(_cost(b), shared=[0, 0]) == _cost(blocks[0]) for b in blocks)
    assert profile.meta["pooled"] == [["0", "1", "2", "3", "4", "5"]]


def test_pool_false_measures_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    profile = profile_layers(
        _model(), torch.randn(4, 16), batch_sizes=SIZES, warmup=0, repeats=1, pool=False
    )
    assert [label for label, _ in calls] == [
        f"layer {i} ({kind})" for i, kind in enumerate(["_Block"] * 6 + ["Linear"]) for _ in SIZES
    ]
    assert "pooled" not in profile.meta
    # Measured one by one, the blocks still agree on their bytes.
    assert len({str(b.saved) + str(b.output) for b in profile.layers[:6]}) == 1


class _Widen(nn.Module):
    """Changes the width, so every layer's input shape tells where it came from."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 2 * width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def test_twins_outputs_feed_the_next_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    layers = [_Block(8), _Block(8), _Block(8), _Widen(8), _Block(16), _Block(16), nn.Linear(16, 1)]
    profile_layers(layers, torch.randn(4, 8), batch_sizes=SIZES, warmup=0, repeats=1)
    seen = {label: shapes for label, shapes in calls[1::2]}
    # One call per batch size; the second (size 4) is listed.
    assert seen == {
        "layer 0 (_Block)": [(4, 8)],
        "layer 3 (_Widen)": [(4, 8)],
        "layer 4 (_Block)": [(4, 16)],
        "layer 6 (Linear)": [(4, 16)],
    }
    assert [shapes for _, shapes in calls[::2]] == [[(2, 8)], [(2, 8)], [(2, 16)], [(2, 16)]]


class _Split(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.tanh()


class _PairBlock(nn.Module):
    """Takes a tuple as one value and returns one, as ``nn.Sequential`` passes them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        a, b = pair
        return a + self.linear(b), b.relu() * a


class _Merge(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0] * pair[1]


def test_repeated_tuple_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    layers = [_Split(), *(_PairBlock() for _ in range(4)), _Merge()]
    sample = torch.randn(4, 16)
    profile = profile_layers(layers, sample, batch_sizes=SIZES, warmup=0, repeats=1)
    assert [label for label, _ in calls[::2]] == [
        "layer 0 (_Split)",
        "layer 1 (_PairBlock)",
        "layer 5 (_Merge)",
    ]
    # Each block gets the pair at each batch size.
    assert [shapes for label, shapes in calls if "_PairBlock" in label] == [
        [(2, 16), (2, 16)],
        [(4, 16), (4, 16)],
    ]
    assert profile.meta["pooled"] == [["1", "2", "3", "4"]]
    assert all(_cost(b) == _cost(profile.layers[2]) for b in profile.layers[2:5])
    assert all(layer.output == [2 * n * 16 * 4 for n in SIZES] for layer in profile.layers[:5])
    counted, measured = counted_and_measured(layers, sample, batch_sizes=SIZES)
    assert byte_differences(counted, measured) == {}
