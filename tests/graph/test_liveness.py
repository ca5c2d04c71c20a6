"""Values live across unit boundaries: carried skips, bytes, invalid cuts, shared tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.graph.layout import layout_model, trace_modes
from autopipe.graph.liveness import analyze
from autopipe.graph.sharing import SharedState
from autopipe.graph.tracing import trace
from autopipe.graph.units import split_units, unit_paths
from profiler.measure import profile_layers
from tests.support.graph_support import layout_of
from tests.support.wrap_models import ResidualMLP, SizeAtRoot, SplitJoin, TiedEnds, TiedPair, UNet


def _names(nodes: list[torch.fx.Node]) -> list[str]:
    return [node.name for node in nodes]


def test_skip_tensors_are_carried_through_the_units_in_between() -> None:
    model = UNet(levels=2)
    x = torch.randn(2, 3, 8, 8)
    layout = layout_of(model, x)
    names = layout.names
    assert names == ["down.0", "down.1", "mid", "ups.0", "up.0", "ups.1", "up.1", "head"]
    live = layout.liveness["any"]
    skip = next(n for n in live.units[0].nodes if n.name == "relu_1")  # down.0's output
    # Live from down.0 until up.1, which concatenates it.
    carrying = [b for b, crossing in enumerate(live.crossing) if skip in crossing]
    assert carrying == [0, 1, 2, 3, 4, 5]
    for k in range(1, 6):
        io = live.units[k]
        assert skip in io.inputs and skip in io.outputs
    assert skip not in live.units[7].inputs
    for k, io in enumerate(live.units):
        assert io.inputs == (live.crossing[k - 1] if k else io.inputs)
        if k < len(live.units) - 1:
            assert io.outputs == live.crossing[k]


def test_bytes_crossing_each_boundary() -> None:
    model = UNet(levels=2)
    layout = layout_of(model, torch.randn(2, 3, 8, 8))
    live = layout.liveness["any"]
    traced = layout.traced["any"]
    for b, crossing in enumerate(live.crossing):
        expected = sum(traced.values[n.name].nbytes for n in crossing)
        assert live.bytes[b] == expected > 0
    # After down.0: its 4-channel 8x8 output (the skip, also pooled in down.1), float32.
    assert live.bytes[0] == 2 * 4 * 8 * 8 * 4


def test_profile_output_is_the_bytes_crossing() -> None:
    model = UNet(levels=2)
    x = torch.randn(2, 3, 8, 8)
    layout = layout_of(model, x)
    profile = profile_layers(layout.modules(), x, batch_sizes=[2], warmup=0, repeats=1)
    outputs = [layer.output[0] for layer in profile.layers]
    assert outputs[:-1] == layout.boundary_bytes()


class _CatWhole(nn.Module):
    def forward(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat(parts, dim=-1)  # the tuple itself, not its parts


def test_a_tuple_crossing_a_boundary_makes_it_invalid() -> None:
    model = SplitJoin()
    model.join = _CatWhole()
    traced = trace(model, (torch.randn(3, 4),))
    units = split_units(traced.graph, unit_paths(model), traced.values)
    live = analyze(traced.graph, units, traced.values)
    assert [u.name for u in units] == ["a", "split", "join", "b"]
    assert set(live.invalid) == {1}
    assert "non-tensor" in live.invalid[1] and "tuple" in live.invalid[1]
    layout = layout_of(model, torch.randn(3, 4))
    assert layout.names == ["a", "split+join", "b"]
    assert layout.merged == ["split | join: non-tensor values cross it: chunk (tuple)"]


def test_a_tuple_unpacked_by_the_next_module_crosses_as_its_parts() -> None:
    model = SplitJoin()  # join reads parts[1] and parts[0]
    layout = layout_of(model, torch.randn(3, 4))
    assert layout.names == ["a", "split", "join", "b"] and not layout.merged
    live = layout.liveness["any"]
    assert [layout.traced["any"].values[n.name].kind for n in live.crossing[1]] == ["tensor"] * 2


def test_sizes_are_recomputed_not_sent() -> None:
    model = SizeAtRoot()
    layout = layout_of(model, torch.randn(5, 4))
    assert layout.names == ["a", "b", "c"] and not layout.merged
    live = layout.liveness["any"]
    last = live.units[-1]
    # x.shape[0] is read again where it is used, from the input carried there.
    assert _names(last.recompute) == ["getattr_1", "getitem"]
    assert "input_0" in _names(last.inputs)
    assert all(
        layout.traced["any"].values[n.name].kind == "tensor" for c in live.crossing for n in c
    )


def test_export_sizes_are_read_from_a_received_tensor() -> None:
    model = SizeAtRoot()
    layout = layout_of(model, torch.randn(5, 4), method="export")
    live = layout.liveness["any"]
    last = live.units[-1]
    # The symbolic batch size comes from the tensor the last unit receives anyway, so the
    # model input is not carried.
    assert last.sizes and not last.recompute
    ((source, dim),) = last.sizes.values()
    assert dim == 0 and source in last.inputs
    assert all(n.op != "placeholder" for c in live.crossing for n in c)


def test_attributes_are_read_where_used() -> None:
    model = ResidualMLP(depth=2)
    layout = layout_of(model, torch.randn(3, 5), method="export")
    live = layout.liveness["any"]
    targets = [[str(a.target) for a in io.attrs] for io in live.units]
    assert targets[1] == [
        "model.blocks.0.norm.weight",
        "model.blocks.0.norm.bias",
        "model.blocks.0.up.weight",
        "model.blocks.0.up.bias",
        "model.blocks.0.down.weight",
        "model.blocks.0.down.bias",
    ]
    assert all(n.op != "get_attr" for c in live.crossing for n in c)


def test_adjacent_units_reading_one_parameter_stay_apart() -> None:
    layout = layout_of(TiedPair(), torch.randn(3, 4))
    assert layout.names == ["first", "a", "b", "last"] and not layout.merged
    assert layout.shared == [SharedState("a.weight", (1, 2))]


def test_distant_units_sharing_a_parameter_are_reported() -> None:
    layout = layout_of(TiedEnds(), torch.randn(3, 4))
    assert layout.names == ["first", "mid1", "mid2", "last"]
    assert layout.shared == [SharedState("first.weight", (0, 3))]


def test_mode_dependent_graphs_share_one_split() -> None:
    from tests.support.wrap_models import DropoutBatchNorm

    model = DropoutBatchNorm(p=0.5)
    layout = layout_of(model, torch.randn(6, 8))
    assert set(layout.traced) == {"train", "eval"} and layout.primary == "train"
    train, evaluation = layout.units["train"], layout.units["eval"]
    assert [u.name for u in train] == [u.name for u in evaluation]
    assert all(u.nodes for u in train)


def test_unit_graphs_chain_into_the_model() -> None:
    torch.manual_seed(0)
    model = UNet(levels=2)
    x = torch.randn(3, 3, 8, 8)
    units = layout_of(model, x).modules()
    values: tuple[torch.Tensor, ...] = (x,)
    for k, unit in enumerate(units):
        # GPipe passes a tuple as one argument; the profiler passes it as *args.
        values = unit(values) if k % 2 else unit(*values)
    (output,) = values
    torch.testing.assert_close(output, model(x))


def test_stage_graphs_of_export_take_the_device_from_their_input() -> None:
    from tests.support.wrap_models import TinyGPT

    model = TinyGPT(depth=1)
    layout = layout_of(model, torch.randint(0, 32, (2, 8)), method="export")
    for unit in layout.modules():
        for graph in unit.graphs.values():
            for node in graph.graph.nodes:
                constants = [*node.args, *node.kwargs.values()]
                assert not any(isinstance(c, torch.device) for c in constants), node.format_node()
    codes = [unit.graphs[layout.primary].code for unit in layout.modules()]
    (code,) = [c for c in codes if "aten.arange" in c]
    assert "tensors_0.device" in code and "device = getattr_1" in code


def test_export_stage_graphs_hold_the_real_batch_norm() -> None:
    from tests.support.wrap_models import DropoutBatchNorm

    model = DropoutBatchNorm()
    layout = layout_of(model, torch.randn(6, 8), method="export")
    index = layout.names.index("layers.0.1")
    graph = layout.modules()[index].graphs["train"]
    bn = model.get_submodule("layers.0.1")
    assert graph.get_submodule("model.layers.0.1") is bn
    assert graph.get_buffer("model.layers.0.1.running_mean") is bn.running_mean


def test_constants_live_in_the_unit_that_uses_them() -> None:
    from tests.support.wrap_models import KeywordModel, ShapeLoop

    fx_layout = layout_model(
        KeywordModel(), trace_modes(KeywordModel(), (torch.randn(3, 4),), {"mask": torch.ones(3)})
    )
    export_layout = layout_of(ShapeLoop(), torch.randn(3, 2, 4))
    for layout, kind in ((fx_layout, "_tensor_constant"), (export_layout, "lifted_tensor")):
        users = [
            k
            for k, io in enumerate(layout.liveness["any"].units)
            if any(kind in str(a.target) for a in io.attrs)
        ]
        assert len(users) == 1
        unit = layout.modules()[users[0]]
        assert any(name.endswith(tuple("0123456789")) for name, _ in unit.named_buffers())


@pytest.mark.parametrize("method", ["fx", "export"])
def test_read_only_buffers_may_be_copied_written_ones_not(method: str) -> None:
    from tests.support.wrap_models import MaskedBlocks

    reading = layout_of(MaskedBlocks(), torch.randn(3, 4), method=method)
    assert reading.names == ["blocks.0", "blocks.1", "blocks.2"]
    assert reading.shared == [] and reading.merged == []
    writing = layout_of(MaskedBlocks(count=True), torch.randn(3, 4), method=method)
    # The counter updates after blocks 0 and 1 run with blocks 1 and 2: together.
    assert writing.names == ["blocks.0", "blocks.1+blocks.2"]
    assert writing.merged == [
        "blocks.1 | blocks.2: both sides use calls, which is written in place"
    ]
    live = writing.liveness["any"]
    assert all(n.op != "get_attr" and "add_" not in n.name for c in live.crossing for n in c)
