"""Tracing models on the meta device: the same units as the model built for real."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.graph.layout import Layout
from autopipe.graph.meta import has_meta_state, rebind_state
from autopipe.graph.sequential import SequentialModel, prepare
from autopipe.graph.tracing import TracingError, trace
from profiler.materialize import materialize
from tests.support.meta_models import ItemGate, MaskedPick, build, gpt2, llama, small_cnn, token_ids
from tests.support.wrap_models import ResidualMLP

pytest.importorskip("transformers")


def _structure(layout: Layout) -> dict[str, Any]:
    """What the units are, independently of the values: names, boundaries, shapes."""
    modes = {}
    for mode, traced in layout.traced.items():
        units = [
            (
                [traced.values[n.name].shape for n in io.inputs],
                [traced.values[n.name].shape for n in io.outputs],
                sorted(str(a.target) for a in io.attrs),
            )
            for io in layout.liveness[mode].units
        ]
        modes[mode] = (traced.method, traced.outputs.labels, units)
    return {
        "names": layout.names,
        "bytes": layout.boundary_bytes(),
        "shared": layout.shared,
        "merged": layout.merged,
        "modes": modes,
    }


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor]]] = {
    "mlp": (ResidualMLP, lambda: torch.randn(6, 5)),
    "cnn": (small_cnn, lambda: torch.randn(4, 3, 6, 6)),
    "gpt2": (gpt2, token_ids),
    "llama": (llama, token_ids),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_meta_model_has_the_units_of_the_real_one(case: str) -> None:
    factory, sample = CASES[case]
    meta, real = build(factory, meta=True), build(factory, meta=False)
    got, want = prepare(meta, sample()), prepare(real, sample())
    assert _structure(got) == _structure(want)
    traced = got.traced[got.primary]
    if traced.method == "export":  # export bakes the sample's device, replaced per stage
        assert traced.device == torch.device("meta")


def test_the_models_state_is_left_on_meta_and_the_units_use_it() -> None:
    model = build(gpt2, meta=True)
    units = SequentialModel.of(prepare(model, token_ids())).sequential()
    assert has_meta_state(model)
    ids = {id(p) for p in model.parameters()}
    assert {id(p) for p in units.parameters()} == ids  # the model's own, none copied


@pytest.mark.parametrize("case", ["mlp", "gpt2", "llama"])
def test_materialized_units_compute_what_the_materialized_model_does(case: str) -> None:
    factory, sample = CASES[case]
    model = build(factory, meta=True)
    x = sample()
    units = SequentialModel.of(prepare(model, x)).sequential()
    materialize(model, "cpu")
    # materialize makes new Parameter objects: export's graphs hold the tensors and must
    # follow them; fx's call the model's modules, which hold the new ones already.
    replaced = rebind_state(units, model)
    assert replaced > 0 if case != "mlp" else replaced == 0
    assert not has_meta_state(units)
    assert {id(p) for p in units.parameters()} == {id(p) for p in model.parameters()}
    model.eval()
    units.eval()
    with torch.no_grad():
        out = model(x)
        want = out if isinstance(out, Tensor) else out.logits
        (got,) = units(x)
    torch.testing.assert_close(got, want)
    assert rebind_state(units, model) == 0  # nothing left to point elsewhere


def test_a_model_partly_on_meta_traces_like_the_real_one() -> None:
    real = build(ResidualMLP, meta=False)
    mixed: Any = build(ResidualMLP, meta=False)
    with torch.device("meta"):
        for i in range(1, len(mixed.blocks)):
            mixed.blocks[i] = type(mixed.blocks[i])(8)
    x = torch.randn(6, 5)
    assert _structure(prepare(mixed, x)) == _structure(prepare(real, x))
    assert not mixed.inp.weight.is_meta and mixed.blocks[2].up.weight.is_meta  # left as it was


def test_a_gpt2_partly_on_meta_keeps_its_real_tensors_in_the_graph() -> None:
    model: Any = build(gpt2, meta=False)
    with torch.device("meta"):
        model.transformer.h[1] = type(model.transformer.h[1])(model.config, layer_idx=1)
    traced = trace(model, (token_ids(),))
    assert traced.method == "export"
    wte = traced.root.get_parameter("model.transformer.wte.weight")
    assert wte is model.transformer.wte.weight and not wte.is_meta
    assert traced.root.get_parameter("model.transformer.h.1.mlp.c_fc.weight").is_meta


@pytest.mark.parametrize(
    ("factory", "construct"), [(ItemGate, "Tensor.item()"), (MaskedPick, "torch.nonzero")]
)
def test_code_that_reads_values_is_refused_on_meta_with_the_fix(
    factory: Callable[[], nn.Module], construct: str
) -> None:
    model = build(factory, meta=True)
    with pytest.raises(TracingError) as info:
        trace(model, (torch.randn(4, 4),))
    message = str(info.value)
    assert "\n" not in message
    assert "on the meta device" in message and construct in message
    assert "Fix: build the model (or the module doing it) with real weights" in message


@pytest.mark.parametrize("factory", [ItemGate, MaskedPick])
def test_the_same_code_traces_with_real_weights(factory: Callable[[], nn.Module]) -> None:
    model = build(factory, meta=False)
    x = torch.randn(4, 4)
    traced = trace(model, (x,))
    assert traced.values[traced.graph.find_nodes(op="output")[0].args[0][0].name].shape == (
        tuple(model(x).shape)
    )


def test_meta_bytes_counts_each_stages_new_tensors_once() -> None:
    from autopipe.graph.meta import meta_bytes

    model = build(gpt2, meta=True)  # tied embedding and head: the first user counts them
    units = SequentialModel.of(prepare(model, (token_ids(),))).units
    stages = [units[:2], units[2:]]
    sizes = meta_bytes(model, stages, [[], []])
    state = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    assert sum(sizes) == sum(t.numel() * t.element_size() for t in state if t.is_meta)
    assert all(size > 0 for size in sizes)
    assert meta_bytes(model, stages[::-1], [[], []])[0] > sizes[1]  # the head's copy is first
    assert has_meta_state(model)  # nothing was materialized
