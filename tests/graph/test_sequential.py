"""A traced model as an nn.Sequential of its units gives the model's outputs, in every mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.graph import ModelIO, SequentialModel, UnitSequential, prepare, unit_sequential
from tests.support.wrap_models import DropoutBatchNorm, KeywordModel, ResidualMLP


def test_unit_sequential_names_its_children_after_the_units_and_computes_the_model():
    torch.manual_seed(0)
    model = ResidualMLP().eval()
    x = torch.randn(4, 5)
    layers, flat = unit_sequential(model, (x,))
    assert isinstance(layers, UnitSequential)
    blocks = [f"blocks/{k}" for k in range(4)]
    assert [name for name, _ in layers.named_children()] == ["inp", *blocks, "out"]
    # The names profiles and plans use are the modules' dotted names.
    assert layers.layer_names == ["inp", *(b.replace("/", ".") for b in blocks), "out"]
    assert len(flat) == 1 and flat[0] is x
    (output,) = layers(*flat)
    torch.testing.assert_close(output, model(x))


def test_model_io_flattens_keyword_inputs_in_any_order_and_rebuilds_the_outputs():
    torch.manual_seed(0)
    model = KeywordModel().eval()
    x, mask, extra = torch.randn(4, 6, 4), torch.ones(4, 6), torch.randn(4, 6, 6)
    kwargs = {"mask": mask, "extra": extra, "scale": 2.0}
    units = SequentialModel.of(prepare(model, (x,), kwargs=kwargs))
    flat = units.io.flatten((x,), {"scale": 2.0, "extra": extra, "mask": mask})
    assert flat == units.io.flatten(x, kwargs)  # a single tensor is the positional inputs
    output = units.sequential()(*flat)
    rebuilt = units.io.rebuild(output, training=False)
    expected = model(x, **kwargs)
    assert rebuilt["scale"] == 2.0
    torch.testing.assert_close(rebuilt["logits"], expected["logits"])
    torch.testing.assert_close(rebuilt["hidden"], expected["hidden"])
    with pytest.raises(ValueError, match="scale"):
        units.io.flatten((x,), {**kwargs, "scale": 3.0})  # a constant baked into the graph


def test_model_io_picks_the_graph_of_the_mode():
    torch.manual_seed(0)
    model = DropoutBatchNorm(p=0.5).train()
    units = SequentialModel.of(prepare(model, torch.randn(8, 8)))
    assert isinstance(units.io, ModelIO)
    assert set(units.io.outputs) == {"train", "eval"}
    assert units.io.key(training=True) == "train" and units.io.key(training=False) == "eval"
    assert units.names == prepare(model, torch.randn(8, 8)).names
    assert all(isinstance(unit, nn.Module) for unit in units.units)
