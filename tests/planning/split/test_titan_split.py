"""Tests for torchtitan's default split (its package is the reference in
test_peer_strategies.py)."""

from __future__ import annotations

import pytest

import autopipe
from autopipe.errors import PlanningError
from autopipe.planning.split.titan_split import has_titan_shape, titan_layer_counts, torchtitan


def _llama(layers: int) -> list[str]:
    return ["tok_embeddings", *(f"layers.{i}" for i in range(layers)), "norm", "output"]


@pytest.mark.parametrize(
    ("stages", "layers", "expected"),
    [
        (1, 8, [8]),
        (2, 8, [4, 4]),  # 10 effective: 5 and 5, less one each end
        (4, 8, [2, 3, 2, 1]),  # 10 effective: 3, 3, 2, 2
        (3, 7, [2, 3, 2]),
        (4, 2, [0, 1, 1, 0]),  # the ends may hold no layer
    ],
)
def test_layer_counts(stages: int, layers: int, expected: list[int]) -> None:
    assert titan_layer_counts(stages, layers) == expected
    assert sum(expected) == layers


@pytest.mark.parametrize(("stages", "layers"), [(5, 2), (11, 8)])
def test_layer_counts_refuse_what_torchtitan_refuses(stages: int, layers: int) -> None:
    with pytest.raises(PlanningError, match="torchtitan's default split refuses"):
        titan_layer_counts(stages, layers)


def test_units_follow_their_layers() -> None:
    assert torchtitan(_llama(8), 4) == [3, 3, 2, 3]
    # Two units per layer, slash names, a two-unit embedding and one output unit.
    names = ["wte", "wpe"] + [f"h/{i}/{part}" for i in range(4) for part in ("attn", "mlp")]
    assert torchtitan([*names, "ln_f+head"], 2) == [2 + 4, 4 + 1]
    assert has_titan_shape([*names, "head"])


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["0", "1", "2", "3"], "no stack of layers"),
        (["layers.0", "layers.1", "norm"], "before the decoder layers"),
        (["emb", "layers.0", "layers.1"], "after the decoder layers"),
        (["emb", "a.0", "a.1", "b.0", "b.1", "out"], "2 stacks"),
        (["emb", "layers.0", "mid", "layers.1", "out"], "runs between"),
        (["emb", "layers.0+layers.1", "layers.2", "out"], "spans several layers"),
        (["emb", "layers.1", "layers.0", "out"], "not one after the other"),
    ],
)
def test_refuses_other_shapes(names: list[str], message: str) -> None:
    assert not has_titan_shape(names)
    with pytest.raises(PlanningError, match=message):
        torchtitan(names, 2)


def test_partition_needs_names() -> None:
    with pytest.raises(ValueError, match="places layers by their names"):
        autopipe.partition([1.0] * 6, 2, strategy="torchtitan")
