"""Models whose tensors are (all or partly) on the meta device (autopipe.graph.meta): traced
into the same units as the model built for real, their state swapped and rebound, the
tensors no unit uses found, each stage's tensors materialized alone."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.graph.layout import Layout
from autopipe.graph.meta import (
    has_meta_state,
    materialize_units,
    meta_construct,
    meta_shadow,
    rebind_state,
    unused_meta,
)
from autopipe.graph.sequential import SequentialModel, prepare
from autopipe.graph.tracing import TracingError, trace
from profiler.materialize import materialize
from tests.support.meta_models import ItemGate, MaskedPick, build, gpt2, llama, small_cnn, token_ids
from tests.support.wrap_models import ResidualMLP

# The Hugging Face cases need transformers; the others run without it.
hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


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


def _cases(*names: str) -> list[Any]:
    return [pytest.param(n, marks=hf) if n in ("gpt2", "llama") else n for n in names]


@pytest.mark.parametrize("case", _cases(*sorted(CASES)))
def test_a_meta_model_has_the_units_of_the_real_one(case: str) -> None:
    factory, sample = CASES[case]
    meta, real = build(factory, meta=True), build(factory, meta=False)
    got, want = prepare(meta, sample()), prepare(real, sample())
    assert _structure(got) == _structure(want)
    traced = got.traced[got.primary]
    if traced.method == "export":  # export bakes the sample's device, replaced per stage
        assert traced.device == torch.device("meta")


@hf
def test_the_models_state_is_left_on_meta_and_the_units_use_it() -> None:
    model = build(gpt2, meta=True)
    units = SequentialModel.of(prepare(model, token_ids())).sequential()
    assert has_meta_state(model)
    ids = {id(p) for p in model.parameters()}
    assert {id(p) for p in units.parameters()} == ids  # the model's own, none copied


@pytest.mark.parametrize("case", _cases("mlp", "gpt2", "llama"))
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


@hf
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


def test_has_meta_state_sees_any_parameter_or_buffer_on_meta() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert not has_meta_state(model)
    model[1].register_buffer("running_mean", torch.zeros(2, device="meta"))
    assert has_meta_state(model)


def test_meta_construct_names_what_read_values_through_wrapped_errors() -> None:
    with pytest.raises(RuntimeError) as info:
        build(ItemGate, meta=True)(torch.randn(4, 4, device="meta"))
    assert meta_construct(info.value) == "Tensor.item() (or a tensor in an if)"
    wrapped = ValueError("tracing failed")  # export wraps the original error: its cause
    wrapped.__cause__ = info.value
    assert meta_construct(wrapped) == "Tensor.item() (or a tensor in an if)"
    assert meta_construct(RuntimeError("shapes cannot be multiplied")) is None


def test_meta_shadow_stands_in_for_the_real_state_and_puts_it_back() -> None:
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight  # tied across the models
    with torch.device("meta"):
        first.extra = nn.Linear(3, 3)  # already on meta: left as it is
    real, meta_extra = first.weight, first.extra.weight
    before = real.detach().clone()
    with meta_shadow(first, second):
        assert first.weight.is_meta and first.bias.is_meta and second.bias.is_meta
        assert second.weight is first.weight  # still one tensor
        assert first.extra.weight is meta_extra
    assert first.weight is real and second.weight is real and not real.is_meta
    torch.testing.assert_close(real.detach(), before)


class _Spare(nn.Module):
    """Holds a buffer beside the head's weights and one of its own that no graph reads."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        self.out.register_buffer("spare", torch.zeros(2))
        self.register_buffer("spare", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.inp(x)))


def _two_stages(model: nn.Module) -> list[list[nn.Module]]:
    """The units in two stages; traced by export, whose graphs hold only the tensors they
    read (fx's call the model's modules, buffers and all)."""
    layout = prepare(model, torch.randn(4, 4), method="export")
    units = list(SequentialModel.of(layout).sequential())
    assert len(units) == 2
    return [units[:1], units[1:]]


def test_unused_meta_tensors_go_with_their_modules_users() -> None:
    model = build(_Spare, meta=True)
    # out.spare beside the head's weights; the root's buffer, with no sibling used, to
    # the first stage. The same on every rank: a function of the model and the stages.
    assert unused_meta(model, _two_stages(model)) == [["spare"], ["out.spare"]]
    real = build(_Spare, meta=False)
    assert unused_meta(real, _two_stages(real)) == [[], []]


def test_materialize_units_gives_one_stage_its_tensors_alone() -> None:
    """Its units' tensors and the extra ones; the buffer no initializer writes is set by
    ``init`` (without it, refused: tests/gpipe/test_meta_wrap.py)."""
    model = build(_Spare, meta=True)
    stages = _two_stages(model)
    extra = unused_meta(model, stages)

    def fill(part: nn.Module) -> None:
        part.get_buffer("out.spare").fill_(1.0)

    part = materialize_units(model, stages[1], "cpu", fill, extra=extra[1])
    assert sorted(part.state_dict()) == ["out.bias", "out.spare", "out.weight"]
    assert model.out.spare.tolist() == [1.0, 1.0]
    assert not model.out.weight.is_meta and not model.out.spare.is_meta
    assert model.inp.weight.is_meta and model.spare.is_meta  # the other stage's, untouched
    # The stage's graphs read the new tensors: it runs on real values.
    (got,) = stages[1][0](torch.randn(3, 4))
    assert got.shape == (3, 2) and not got.is_meta


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
