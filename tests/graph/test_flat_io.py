"""Nested inputs and outputs as flat tuples of tensors (autopipe.graph.flat_io): their
structure, the constants baked in, and the batch dimension they share."""

from __future__ import annotations

import math

import pytest
import torch

from autopipe.graph.flat_io import FlatSpec, check_batch_major


def test_flat_spec_round_trip_and_structure_check() -> None:
    value = ((torch.ones(2), 3), {"a": None, "b": torch.zeros(2)})
    spec, tensors = FlatSpec.of(value, top=("args", "kwargs"))
    assert len(tensors) == 2 and spec.label(1) == "kwargs['b']"
    rebuilt = spec.rebuild(tensors)
    assert rebuilt[0][1] == 3 and rebuilt[1]["a"] is None
    with pytest.raises(ValueError, match="structure"):
        spec.flatten(((torch.ones(2),), {}), "inputs")


def test_tensors_come_in_flattening_order_with_their_paths() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    spec, tensors = FlatSpec.of({"x": a, "y": [b, 7, {"z": c}]})
    assert [t is u for t, u in zip(tensors, (a, b, c))] == [True] * 3
    assert [spec.label(i) for i in range(3)] == ["['x']", "['y'][0]", "['y'][2]['z']"]
    assert spec.leaves == [None, None, 7, None] and spec.slots == [0, 1, 3]
    flat = spec.flatten({"x": c, "y": [a, 7, {"z": b}]}, "outputs")
    assert [t is u for t, u in zip(flat, (c, a, b))] == [True] * 3


def test_a_value_without_tensors_has_no_slots() -> None:
    spec, tensors = FlatSpec.of((1, None, "mode"))
    assert tensors == () and spec.slots == []
    assert spec.rebuild([]) == (1, None, "mode")


def test_a_single_tensor_is_its_own_structure() -> None:
    x = torch.ones(2)
    spec, tensors = FlatSpec.of(x)
    assert tensors == (x,) and spec.labels == [""]
    assert spec.rebuild([x * 2]).tolist() == [2.0, 2.0]


def test_a_tensor_slot_must_hold_a_tensor() -> None:
    spec, _ = FlatSpec.of((torch.ones(2), 3), top=("args", "kwargs"))
    with pytest.raises(ValueError, match=r"inputs: args was a tensor when traced, got float"):
        spec.flatten((1.5, 3), "inputs")


def test_constants_compare_by_identity_first() -> None:
    nan = math.nan
    spec, _ = FlatSpec.of((torch.ones(1), nan, None))
    assert len(spec.flatten((torch.ones(1), nan, None), "inputs")) == 1
    with pytest.raises(ValueError, match=r"\[2\] was the constant None when traced"):
        spec.flatten((torch.ones(1), nan, 0), "inputs")
    # Equal values of another type are another constant: True is not 1.
    spec, _ = FlatSpec.of((torch.ones(1), 1))
    with pytest.raises(ValueError, match="baked into the graph"):
        spec.flatten((torch.ones(1), True), "inputs")


def test_rebuild_needs_one_tensor_per_slot() -> None:
    spec, tensors = FlatSpec.of([torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError):
        spec.rebuild(tensors[:1])


def test_check_batch_major_returns_the_shared_batch_size() -> None:
    assert check_batch_major([(4, 3), (4,), (4, 2, 2)], ["a", "b", "c"], "inputs") == 4


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        ([], "the model's outputs contain no tensor"),
        ([(4, 3), ()], "outputs b is a 0-d tensor"),
        ([(4, 3), (5, 3)], r"dim-0 sizes differ \(a: 4, b: 5\)"),
        ([(0, 3), (0,)], r"the outputs have an empty batch \(dim 0 is 0\)"),
    ],
)
def test_check_batch_major_refuses(shapes: list[tuple[int, ...]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_batch_major(shapes, ["a", "b"][: len(shapes)], "outputs")
