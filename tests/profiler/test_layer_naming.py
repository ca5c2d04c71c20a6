"""The names a profile gives a Sequential's layers, and the two spellings of a unit's name."""

from __future__ import annotations

import torch
from torch import nn

from autopipe.graph import unit_sequential
from profiler import profile_model
from profiler.layer_naming import layer_names, same_layer_name
from tests.support.export_models import MLP


def test_a_plain_sequential_is_named_by_its_children() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert layer_names(model) == ["0", "1"]


def test_traced_units_are_named_by_their_modules_dotted_names() -> None:
    torch.manual_seed(0)
    units, flat = unit_sequential(MLP(depth=2), torch.randn(4, 8))
    expected = ["inp", "blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "head"]
    assert layer_names(units) == expected
    assert [name for name, _ in units.named_children()][1] == "blocks/0/0"  # no dot allowed
    profile = profile_model(units, flat, repeats=1, warmup=0)
    assert profile.names == expected


def test_slash_and_dot_spellings_match() -> None:
    assert same_layer_name("transformer/h/3", "transformer.h.3")
    assert same_layer_name("h.3", "h.3") and not same_layer_name("h.3", "h.4")
