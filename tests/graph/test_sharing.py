"""Tensors several units use (autopipe.graph.sharing): which a unit must share, which it
may write, their names, and the placements that would need a copy of a written one."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.sharing import (
    SharedState,
    adjacent_boundaries,
    check_placement,
    copied_written,
    find_shared,
    find_written,
    graph_writes,
    unit_state,
    unit_writes,
)
from tests.support.wrap_models import TiedPair


class Counted(nn.Module):
    """A Linear, a parameter and two buffers read as attributes: one only read, one
    counted up in place, and a batch norm whose running statistics it updates."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("mask", torch.ones(4))
        self.register_buffer("calls", torch.zeros(()))
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        self.calls.add_(x.new_ones(()))  # a traced argument: fx records the write
        return self.norm(self.linear(x) * self.scale * self.mask)


def _attr_nodes(graph: fx.GraphModule) -> dict[str, fx.Node]:
    """The graph's ``get_attr`` and ``call_module`` nodes, by target."""
    return {str(n.target): n for n in graph.graph.nodes if n.op in ("get_attr", "call_module")}


def _same(found: list[Tensor], expected: list[Tensor]) -> bool:
    return sorted(map(id, found)) == sorted(map(id, expected))


def test_unit_state_is_parameters_and_buffers_that_may_be_written() -> None:
    model = Counted()
    graph = fx.symbolic_trace(model)
    nodes = _attr_nodes(graph)
    assert set(nodes) == {"calls", "linear", "scale", "mask", "norm"}
    # A read-only buffer may be copied: it is not state to share.
    assert unit_state(graph, [nodes["mask"]]) == []
    assert _same(unit_state(graph, [nodes["scale"]]), [model.scale])
    assert _same(unit_state(graph, [nodes["calls"]]), [model.calls])
    assert _same(unit_state(graph, [nodes["linear"]]), list(model.linear.parameters()))
    norm = [*model.norm.parameters(), *model.norm.buffers()]
    assert _same(unit_state(graph, [nodes["norm"]]), norm)


def test_unit_writes_are_buffers_of_called_modules_and_attributes_written_in_place() -> None:
    model = Counted()
    graph = fx.symbolic_trace(model)
    nodes = list(_attr_nodes(graph).values())
    assert _same(unit_writes(graph, nodes), [model.calls, *model.norm.buffers()])


def test_graph_writes_are_the_buffers_written_in_place_with_their_owners() -> None:
    class Steps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))
            self.register_buffer("scale", torch.ones(()))

        def forward(self, x: Tensor) -> Tensor:
            self.steps.add_(1)
            return x * self.scale

    model = Steps()
    assert graph_writes(fx.symbolic_trace(model)) == []  # buffers are constants without proxies
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True
    graph = fx.GraphModule(model, tracer.trace(model))
    assert [(owner is graph, name) for owner, name in graph_writes(graph)] == [(True, "steps")]
    counted = fx.symbolic_trace(Counted())
    names = {name for _, name in graph_writes(counted)}
    assert {"calls", "running_mean", "running_var", "num_batches_tracked"} <= names


def test_find_written_names_what_the_units_write() -> None:
    model = Counted()
    writes = [[model.calls], [model.norm.running_mean], [torch.zeros(1)]]  # not the model's
    assert find_written(model, writes) == {"calls", "norm.running_mean"}
    assert find_written(model, []) == set()


def test_a_tensor_one_unit_uses_is_not_shared() -> None:
    model = TiedPair()
    state = [[model.first.weight, model.first.weight], [model.last.weight]]
    assert find_shared(model, state) == []


def test_a_tied_tensor_takes_its_first_name() -> None:
    model = TiedPair()  # b.weight is a.weight
    assert find_shared(model, [[model.b.weight], [], [model.a.weight]]) == [
        SharedState("a.weight", (0, 2))
    ]
    assert (
        adjacent_boundaries(find_shared(model, [[model.b.weight], [], [model.a.weight]])) == set()
    )


def test_adjacent_boundaries_of_several_tensors() -> None:
    shared = [SharedState("w", (0, 1, 2)), SharedState("v", (3, 4)), SharedState("u", (1, 5))]
    assert adjacent_boundaries(shared) == {0, 1, 3}
    assert adjacent_boundaries([]) == set()


def test_check_placement_names_every_unit_of_the_written_tensor() -> None:
    shared = [SharedState("norm.running_mean", (0, 2))]
    names = ["embed", "block", "head"]
    with pytest.raises(ValueError) as caught:
        check_placement(shared, [0, 0, 1], ["cpu", "meta"], names, written={"norm.running_mean"})
    message = str(caught.value)
    assert message.startswith("norm.running_mean is shared by units on different devices: ")
    assert "embed (stage 0, cpu), head (stage 1, meta)" in message
    assert message.endswith("give those stages the same device, use fewer stages, or untie it")
    # Read-only tensors and units on one stage need no copy.
    check_placement(shared, [0, 0, 1], ["cpu", "meta"], names)
    check_placement(
        shared, [0, 0, 0], ["cpu"], names, written={"norm.running_mean"}, replicate=True
    )


def test_find_shared_and_adjacency() -> None:
    model = TiedPair()
    state = [[model.first.weight], [model.a.weight], [model.b.weight, model.b.bias]]
    shared = find_shared(model, state)
    assert shared == [SharedState("a.weight", (1, 2))]
    assert adjacent_boundaries(shared) == {1}
    assert adjacent_boundaries([SharedState("w", (0, 2, 3))]) == {2}


def test_check_placement() -> None:
    shared = [SharedState("wte.weight", (0, 3))]
    names = ["wte", "h.0", "h.1", "lm_head"]
    check_placement(shared, [0, 0, 1, 1], ["cpu", "cpu"], names)  # one device: fine
    check_placement(shared, [0, 0, 1, 1], ["cuda:0", "cuda"], names)
    check_placement(shared, [0, 0, 0, 0], ["cpu", "meta"], names)
    # On two devices each stage holds a copy, unless the units write the tensor.
    check_placement(shared, [0, 0, 1, 1], ["cpu", "meta"], names)
    written = {"wte.weight"}
    check_placement(shared, [0, 0, 1, 1], ["cpu", "cpu"], names, written=written)
    with pytest.raises(ValueError, match=r"wte\.weight is shared by units on different devices"):
        check_placement(shared, [0, 0, 1, 1], ["cpu", "meta"], names, written=written)
    with pytest.raises(ValueError, match=r"written during forward"):
        check_placement(shared, [0, 0, 1, 1], ["cpu", "cpu"], names, written, replicate=True)


def test_copied_written_names_what_the_planner_keeps_on_one_stage() -> None:
    shared = [SharedState("wte.weight", (0, 3)), SharedState("norm.running_mean", (1, 3))]
    written = {"norm.running_mean"}
    assert copied_written(shared, ["cpu", "cpu"], written) == []  # one tensor for both
    assert copied_written(shared, ["cpu"], written, replicate=True) == []
    assert copied_written(shared, ["cpu", "cpu"], written, True) == ["norm.running_mean"]
    assert copied_written(shared, ["cpu", "meta"], written) == ["norm.running_mean"]
    assert copied_written(shared, ["cpu", "meta"], set()) == []
