"""Tests of the torch.export graph clean-ups (autopipe.graph.export)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.export import drop_constant_copies, export_graph

COPY = torch.ops.aten.lift_fresh_copy.default


class Pick(nn.Module):
    """Indexes with a list, which export lifts into a constant and copies before use."""

    def forward(self, *inputs: Tensor) -> Tensor:  # flat inputs, as the tracer passes them
        return inputs[0][:, [0, 2]] * 2


class Bump(nn.Module):
    """Writes its constant's copy: the copy must stay."""

    def forward(self, *inputs: Tensor) -> Tensor:
        index = torch.tensor([0, 1])
        index.add_(1)
        return inputs[0][:, index] * 2


def _copies(graph: fx.Graph) -> int:
    return len(graph.find_nodes(op="call_function", target=COPY))


def test_a_constant_only_read_is_read_in_place_of_its_copy() -> None:
    x = torch.randn(4, 3)
    root, graph, _ = export_graph(Pick(), (x,))
    assert _copies(graph) == 1
    drop_constant_copies(graph)
    assert _copies(graph) == 0
    out = fx.GraphModule(root, graph)(x)
    torch.testing.assert_close(out, Pick()(x))


def test_a_constant_written_keeps_its_copy() -> None:
    x = torch.randn(4, 3)
    root, graph, _ = export_graph(Bump(), (x,))
    before = _copies(graph)
    assert before == 1
    drop_constant_copies(graph)
    assert _copies(graph) == before
    for _ in range(2):  # the constant itself is not bumped: each call computes the same
        out = fx.GraphModule(root, graph)(x)
        torch.testing.assert_close(out, Bump()(x))
