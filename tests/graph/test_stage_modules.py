"""One graph module per unit (autopipe.graph.stage_modules): each takes and returns the tensors
live across its boundaries, shares the model's state, picks the graph of its mode, and the
units in order compute the model."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.meta import rebind_state
from autopipe.graph.sequential import prepare
from autopipe.graph.stage_modules import UnitModule, UnitSequential, build_graph_module
from profiler.materialize import materialize
from tests.support.meta_models import build
from tests.support.wrap_models import ResidualMLP


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_each_graph_module_hands_on_its_live_tensors_and_all_compute_the_model(
    method: str,
) -> None:
    torch.manual_seed(0)
    model, x = ResidualMLP().eval(), torch.randn(4, 5)
    layout = prepare(model, x, method=method)
    traced, live = layout.traced[layout.primary], layout.liveness[layout.primary]
    values: tuple[Tensor, ...] = (x,)
    for io in live.units:
        module = build_graph_module(traced, io)
        assert len(module.graph.find_nodes(op="placeholder")) == len(io.inputs)
        values = module(*values)
        assert isinstance(values, tuple) and len(values) == len(io.outputs)
        # The model's own parameters, none copied.
        own = {id(p) for p in model.parameters()}
        assert {id(p) for p in module.parameters()} <= own
    torch.testing.assert_close(values[0], model(x))


def test_a_graph_module_reading_batch_norm_state_holds_the_module_itself() -> None:
    """Re-computation restores running statistics through the module: a copy would not do."""
    torch.manual_seed(0)
    model = _Norm().train()
    layout = prepare(model, torch.randn(8, 4), method="export", granularity="leaves")
    traced = layout.traced[layout.primary]
    [holder] = [
        io
        for io in layout.liveness[layout.primary].units
        if any("norm" in str(a.target) for a in io.attrs)
    ]
    module = build_graph_module(traced, holder)
    assert any(sub is model.norm for sub in module.modules())


class _Positions(nn.Module):
    """Makes a tensor on its input's device: export bakes that device into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.inp(x) + torch.arange(4, device=x.device, dtype=x.dtype)


def test_a_device_export_baked_in_becomes_the_inputs() -> None:
    """Traced on meta, the units run on the device their inputs are on."""
    model = build(_Positions, meta=True)
    layout = prepare(model, torch.randn(2, 4), method="export")
    traced = layout.traced[layout.primary]
    assert traced.device == torch.device("meta")
    modules = [build_graph_module(traced, io) for io in layout.liveness[layout.primary].units]
    materialize(model, "cpu")
    units = UnitSequential(*(UnitModule(f"u{k}", {"any": m}) for k, m in enumerate(modules)))
    rebind_state(units, model)
    x = torch.randn(2, 4)
    (got,) = units(x)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, model(x))


def _graph(function: object) -> fx.GraphModule:
    return fx.symbolic_trace(function)  # type: ignore[arg-type]


def _plus(x: Tensor, y: Tensor) -> tuple[Tensor]:
    return (x + y,)


def _minus(x: Tensor, y: Tensor) -> tuple[Tensor]:
    return (x - y,)


def test_a_unit_runs_the_graph_of_its_mode() -> None:
    unit = UnitModule("block", {"train": _graph(_plus), "eval": _graph(_minus)})
    x, y = torch.ones(2), torch.full((2,), 3.0)
    assert unit.train()(x, y)[0].tolist() == [4.0, 4.0]
    assert unit.eval()(x, y)[0].tolist() == [-2.0, -2.0]
    assert unit((x, y))[0].tolist() == [-2.0, -2.0]  # one tuple, as GPipe passes them
    assert set(unit.graphs) == {"train", "eval"}
    # The name shows in the repr; the profiler pools by cost_repr, which the name leaves out.
    assert unit.extra_repr() == "name='block'" and unit.cost_repr() == ""


def test_a_unit_of_one_graph_runs_it_in_both_modes() -> None:
    unit = UnitModule("block", {"any": _graph(_plus)})
    x = torch.ones(2)
    assert unit.train()(x, x)[0].tolist() == unit.eval()(x, x)[0].tolist() == [2.0, 2.0]


def test_a_unit_refuses_a_mode_it_was_not_traced_in_and_other_arities() -> None:
    unit = UnitModule("block", {"eval": _graph(_minus)})
    x = torch.ones(2)
    with pytest.raises(RuntimeError, match="traced in eval mode only; it cannot run in train"):
        unit.train()(x, x)
    with pytest.raises(RuntimeError, match=r"unit block \(eval\) expects 2 tensors but got 3"):
        unit.eval()(x, x, x)


def test_unit_sequential_passes_each_units_tuple_on_and_names_the_layers() -> None:
    """Called with the flat inputs; a unit's name (dotted) is its layer name, another
    layer's its key (tests/graph/test_sequential.py builds one from a traced model)."""
    first = UnitModule("h.0", {"any": _graph(_plus)})
    second = UnitModule("h.1", {"any": _graph(lambda x: (2 * x,))})
    layers = UnitSequential(first, second)
    assert layers(torch.ones(2), torch.ones(2))[0].tolist() == [4.0, 4.0]
    assert layers.layer_names == ["h.0", "h.1"]
    assert UnitSequential(first, nn.Identity()).layer_names == ["h.0", "1"]
