"""Tensors several layers use: found by the profiler, and planned as the stages hold them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from autopipe.graph import unit_sequential
from autopipe.planning.planner import evaluate
from profiler.measure import profile_layers, profile_model
from profiler.profile import TiedState
from profiler.tied import tensor_uses, tied_state
from tests.support.planning_cases import splits
from tests.support.wrap_models import TiedEnds, TinyGPT

FAST = {"repeats": 1, "warmup": 0}


def _units(model: nn.Module, sample: Tensor) -> tuple[nn.Sequential, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return unit_sequential(model, (sample,))


def test_tensor_uses_lists_every_tensor_with_its_layers_in_first_use():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    norm = nn.BatchNorm1d(4)
    layers = [nn.Sequential(a, norm), nn.Tanh(), nn.Sequential(norm, b)]
    uses = tensor_uses(layers)
    tensors = [a.weight, a.bias, norm.weight, norm.bias]
    tensors += [norm.running_mean, norm.running_var, norm.num_batches_tracked, b.bias]
    assert [u.tensor for u in uses] == tensors
    assert [u.layers for u in uses] == [[0, 2], [0], [0, 2], [0, 2], [0, 2], [0, 2], [0, 2], [2]]
    assert uses[0].names == ["0.weight", "1.weight"] and uses[4].names == [
        "1.running_mean",
        "0.running_mean",
    ]
    assert [u.buffer for u in uses] == [False] * 4 + [True] * 3 + [False]
    with pytest.raises(ValueError, match="got 2 names for 3 layers"):
        tied_state(layers, ["x", "y"])


def test_traced_units_name_the_models_tensor():
    model = TiedEnds()
    units, flat = _units(model, torch.randn(4, 4))
    names = [name for name, _ in units.named_children()]
    found = profile_layers(list(units), flat, names=names, owner=model, **FAST).tied
    assert found == [TiedState(names=["first.weight", "last.weight"], layers=[0, 3], bytes=64)]
    # Without the model, the layers name it.
    alone = profile_layers(list(units), flat, names=names, **FAST).tied
    assert [t.layers for t in alone] == [[0, 3]] and alone[0].names[0].startswith("first.")


def test_a_sequential_whose_children_share_a_weight():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    found = profile_model(nn.Sequential(a, nn.Tanh(), b), torch.randn(4, 4), **FAST).tied
    assert found == [TiedState(names=["0.weight", "2.weight"], layers=[0, 2], bytes=64)]
    untied = profile_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(4, 4), **FAST)
    assert untied.tied == []


def _held_bytes(units: list[nn.Module]) -> tuple[int, int]:
    """Bytes of the distinct parameters and buffers a stage of ``units`` holds."""
    params = {id(p): p for unit in units for p in unit.parameters()}
    buffers = {id(b): b for unit in units for b in unit.buffers()}

    def size(tensors: dict[int, Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors.values())

    return size(params), size(buffers)


@pytest.mark.parametrize(
    ("model", "sample", "stages"),
    [
        (TiedEnds(), torch.randn(4, 4), (1, 2, 3)),
        (TinyGPT(), torch.randint(0, 32, (4, 8)), (1, 2, 3)),
    ],
    ids=["tied-ends", "tiny-gpt"],
)
def test_planned_parameter_bytes_equal_each_stages_own(model, sample, stages):
    """Every split: a stage's planned parameters, gradients, optimizer state and buffers
    are what its units hold, a tied tensor once on every stage that uses it."""
    units, flat = _units(model, sample)
    layers = list(units)
    names = [name for name, _ in units.named_children()]
    profile = profile_layers(layers, flat, names=names, owner=model, **FAST)
    assert profile.tied  # the head's (or last layer's) weight is the first layer's
    for k in stages:
        for balance in splits(len(layers), k):
            result = evaluate(profile, balance, optimizer="adam", checkpoint="never")
            for stage in result.stages:
                params, buffers = _held_bytes(layers[stage.start : stage.stop])
                assert stage.param_memory == (2 + 2) * params + buffers, balance


def test_wrap_profiles_tied_tensors_by_the_models_names():
    from autopipe import wrap

    wrapped = wrap(TiedEnds(), (torch.randn(4, 4),), stages=2, chunks=2)
    tied = wrapped.plan.profile["tied"]
    assert tied == [
        {"names": ["first.weight", "last.weight"], "layers": [0, 3], "bytes": 64, "buffer": False}
    ]
    assert [t.stages for t in wrapped.plan.tied] == [[0, 1]]
