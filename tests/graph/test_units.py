"""Grouping traced nodes into units: granularity, glue code, repeated calls, regrouping."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.liveness import analyze
from autopipe.graph.tracing import trace
from autopipe.graph.units import (
    GRANULARITIES,
    Unit,
    merge_units,
    module_path,
    regroup,
    split_units,
    unit_paths,
)
from tests.support.tuple_models import (
    AttentionStack,
    DataclassBlock,
    DataclassBlocks,
    DictBlock,
    DictBlocks,
    GRUStack,
    LSTMStack,
    NestedLSTM,
    StateBlock,
    StateSkip,
)
from tests.support.wrap_models import DataDependent, ResidualMLP, TinyGPT, UNet


def _names(units: list[Unit]) -> list[str]:
    return [unit.name for unit in units]


def test_children_granularity() -> None:
    assert unit_paths(TinyGPT(), "children") == {"wte", "wpe", "drop", "blocks", "ln_f", "lm_head"}


def test_blocks_granularity_opens_repeated_blocks() -> None:
    paths = unit_paths(TinyGPT(depth=2), "blocks")
    assert paths == {"wte", "wpe", "drop", "blocks.0", "blocks.1", "ln_f", "lm_head"}


def test_blocks_granularity_opens_modules_holding_repeated_blocks() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.layers = nn.ModuleList(ResidualMLP().blocks[:3])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    paths = unit_paths(Model(), "blocks")
    # Containers are opened (head), blocks without repeated blocks inside are kept whole.
    assert paths == {
        "encoder.embed",
        "encoder.layers.0",
        "encoder.layers.1",
        "encoder.layers.2",
        "head.0",
        "head.1",
    }


def test_blocks_keeps_a_block_with_an_inner_sequential_of_leaves() -> None:
    assert "down.0" in unit_paths(UNet(), "blocks")


def test_leaves_granularity() -> None:
    paths = unit_paths(ResidualMLP(depth=1), "leaves")
    assert paths == {"inp", "blocks.0.norm", "blocks.0.up", "blocks.0.down", "out"}


def test_unknown_granularity() -> None:
    with pytest.raises(ValueError, match="granularity"):
        unit_paths(ResidualMLP(), "layers")


def test_units_follow_module_calls_in_order() -> None:
    model = ResidualMLP(depth=2)
    traced = trace(model, (torch.randn(3, 5),))
    units = split_units(traced.graph, unit_paths(model, "blocks"), traced.values)
    assert _names(units) == ["inp", "blocks.0", "blocks.1", "out"]
    order = {node: i for i, node in enumerate(traced.graph.nodes)}
    flat = [order[node] for unit in units for node in unit.nodes]
    assert flat == sorted(flat)  # contiguous, topological
    leaves = split_units(traced.graph, unit_paths(model, "leaves"), traced.values)
    assert _names(leaves)[:4] == ["inp", "blocks.0.norm", "blocks.0.up", "blocks.0.down"]


def test_glue_code_joins_the_next_call() -> None:
    model = UNet(levels=2)
    traced = trace(model, (torch.randn(2, 3, 8, 8),))
    units = split_units(traced.graph, unit_paths(model, "blocks"), traced.values)
    assert _names(units) == ["down.0", "down.1", "mid", "ups.0", "up.0", "ups.1", "up.1", "head"]
    by_name = {unit.name: unit for unit in units}
    # max_pool2d after down.0 runs in down.1; the concatenation with the skip in up.0.
    assert any(n.name == "max_pool2d" for n in by_name["down.1"].nodes)
    assert any(n.target is torch.cat for n in by_name["up.0"].nodes)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.shared(self.other(self.shared(x)))


def test_a_module_called_twice_makes_two_units() -> None:
    model = _Twice()
    traced = trace(model, (torch.randn(2, 4),))
    units = split_units(traced.graph, unit_paths(model), traced.values)
    assert _names(units) == ["shared", "other", "shared#2"]


def test_an_opaque_call_is_a_unit_even_when_it_would_be_opened() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = ResidualMLP(depth=2)
            self.head = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.inner(x))

    model = Outer()
    traced = trace(model, (torch.randn(2, 5),), leaf_modules=["inner"])
    units = split_units(traced.graph, unit_paths(model, "blocks"), traced.values)
    assert _names(units) == ["inner", "head"]


def test_module_path_of_export_nodes() -> None:
    model = TinyGPT(depth=1)
    traced = trace(model, (torch.randint(0, 32, (2, 8)),), method="export")
    paths = {module_path(n) for n in traced.graph.nodes if n.op == "call_function"}
    assert {"", "wte", "blocks.0.attn", "blocks.0.mlp.0", "lm_head"} <= paths
    assert not any(p.startswith("model") for p in paths)


def test_merge_units() -> None:
    units = [Unit([name]) for name in "abcde"]
    assert _names(merge_units(units, {0, 2, 3})) == ["a+b", "c+d+e"]
    assert _names(merge_units(units, [])) == list("abcde")


def test_regroup_follows_a_layout() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(operator.neg, (x,)) for _ in range(4)]
    runs = [Unit(["a"], [nodes[0]]), Unit(["new"], [nodes[1]]), Unit(["b"], nodes[2:3])]
    runs.append(Unit(["c"], [nodes[3]]))
    layout = [Unit(["a"]), Unit(["b", "c"])]
    grouped = regroup(runs, layout)
    assert _names(grouped) == ["a", "b+c"]
    # A call unknown to the layout joins the next known one.
    assert grouped[0].nodes == [nodes[0]] and grouped[1].nodes == nodes[1:]
    with pytest.raises(ValueError, match="cannot share one split"):
        regroup([runs[3], runs[0]], layout)


def test_a_single_unit_when_nothing_is_a_module() -> None:
    class Functional(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.relu(x) * 2

    traced = trace(Functional(), (torch.randn(2, 3),))
    units = split_units(traced.graph, unit_paths(Functional()), traced.values)
    assert _names(units) == ["forward"] and len(units[0].nodes) == 2


def test_leaf_gate_is_a_unit() -> None:
    model = DataDependent()
    traced = trace(model, (torch.randn(2, 4),), leaf_modules=["gate"])
    assert _names(split_units(traced.graph, unit_paths(model), traced.values)) == ["a", "gate", "b"]


_TUPLE_UNITS = {
    "lstm": ["lstm1", "lstm2", "lstm3", "head"],
    "gru": ["gru1", "gru2", "head"],
    "nested": ["lstm", "mid", "head"],
    "attention": ["attns.0", "attns.1", "attns.2", "head"],
}


def _tuple_model(name: str) -> tuple[nn.Module, Tensor]:
    if name == "lstm":
        return LSTMStack(), torch.randn(2, 5, 4)
    if name == "gru":
        return GRUStack(), torch.randn(2, 5, 4)
    if name == "nested":
        return NestedLSTM(), torch.randn(2, 1, 4)
    return AttentionStack(), torch.randn(2, 5, 8)


@pytest.mark.parametrize("granularity", ["blocks", "leaves"])
@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("name", list(_TUPLE_UNITS))
def test_modules_returning_tuples_are_units(name: str, method: str, granularity: str) -> None:
    model, x = _tuple_model(name)
    traced = trace(model, (x,), method=method)
    units = split_units(traced.graph, unit_paths(model, granularity), traced.values)
    assert _names(units) == _TUPLE_UNITS[name]
    # Unpacking the result (the getitem nodes) stays with the module that made it.
    owner = {node: k for k, unit in enumerate(units) for node in unit.nodes}
    for node in traced.graph.nodes:
        if node.target is operator.getitem and traced.values[node.args[0].name].kind == "other":
            assert owner[node] == owner[node.args[0]], node.name


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_boundaries_after_a_tuple_result_can_be_cut(granularity: str) -> None:
    model = LSTMStack()
    traced = trace(model, (torch.randn(2, 5, 4),), method="fx")
    units = split_units(traced.graph, unit_paths(model, granularity), traced.values)
    assert _names(units) == ["lstm1", "lstm2", "lstm3", "head"]
    live = analyze(traced.graph, units, traced.values)
    # Only each LSTM's output crosses; its unused final state stays behind.
    assert not live.invalid and [len(crossing) for crossing in live.crossing] == [1, 1, 1]


@pytest.mark.parametrize(
    ("build", "leaf", "expected"),
    [
        (StateSkip, StateBlock, [f"blocks.{k}" for k in range(4)] + ["head"]),
        (DictBlocks, DictBlock, [f"blocks.{k}" for k in range(4)] + ["head"]),
        (DataclassBlocks, DataclassBlock, [f"blocks.{k}" for k in range(3)] + ["head"]),
    ],
)
def test_unpacking_an_opaque_block_joins_it(
    build: type[nn.Module], leaf: type[nn.Module], expected: list[str]
) -> None:
    # fx records ``block(x).last_hidden_state`` in the next module's code, and a tuple's
    # getitem in the model's: either way, it belongs to the block.
    model = build()
    traced = trace(model, (torch.randn(2, 6),), method="fx", leaf_modules=[leaf])
    units = split_units(traced.graph, unit_paths(model, "blocks"), traced.values)
    assert _names(units) == expected
    for unit in units:
        unpacking = [n for n in unit.nodes if n.target in (operator.getitem, getattr)]
        assert all(n.args[0] in unit.nodes for n in unpacking), unit.name


def test_a_computed_key_is_not_unpacking() -> None:
    class Pick(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 4, batch_first=True)
            self.index = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            out = self.lstm(x)
            return self.index(out[x.dim() - 3])  # the key comes from the graph

    traced = trace(Pick(), (torch.randn(2, 3, 4),), method="fx")
    units = split_units(traced.graph, unit_paths(Pick(), "blocks"), traced.values)
    (pick,) = (n for n in traced.graph.nodes if n.target is operator.getitem)
    assert pick in units[1].nodes
