"""The checks a trace must pass (autopipe.graph.trace_checks): the graph computes the model's
outputs and buffer updates, and gives gradients exactly where the model does."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.trace_checks import GradientMismatch, verify_gradients, verify_outputs
from autopipe.graph.values import run_quietly
from tests.support.meta_models import ItemGate, build


class _Flat(nn.Module):
    """A model as the tracer checks it: tensors in, a tuple of tensors out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return (self.model(x),)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def test_a_graph_computing_the_models_results_passes() -> None:
    flat, x = _Flat(_mlp()), torch.randn(8, 4)
    graph = fx.symbolic_trace(flat)
    assert verify_outputs(flat, (x,), run_quietly(flat, graph, x), "fx") is True


def test_other_outputs_fail_fx_and_warn_for_export() -> None:
    flat, x = _Flat(_mlp()), torch.randn(8, 4)
    wrong = run_quietly(flat, lambda t: (flat(t)[0] + 1.0,), x)
    with pytest.raises(ValueError, match="the fx graph does not compute the model's outputs"):
        verify_outputs(flat, (x,), wrong, "fx")
    with pytest.warns(UserWarning, match="wrap\\(\\): the export graph does not compute"):
        assert verify_outputs(flat, (x,), wrong, "export") is True  # export is trusted


def test_other_buffer_updates_fail() -> None:
    """Batch norm's running statistics are part of what the graph must compute."""
    flat, x = _Flat(_mlp()), torch.randn(8, 4)
    frozen = run_quietly(flat, flat, x)
    frozen[1].update({key: value + 1.0 for key, value in frozen[1].items()})
    with pytest.raises(ValueError, match="outputs or buffer updates"):
        verify_outputs(flat, (x,), frozen, "fx")


def test_code_that_reads_values_on_meta_refuses_fx_and_leaves_export_unchecked() -> None:
    flat = _Flat(build(ItemGate, meta=True))
    x = torch.randn(4, 4, device="meta")
    result = ((torch.empty(4, 4, device="meta"),), {})
    with pytest.raises(ValueError, match=r"cannot run on the meta device \(Tensor.item\(\)"):
        verify_outputs(flat, (x,), result, "fx")
    assert verify_outputs(flat, (x,), result, "export") is False


def test_an_error_of_the_model_itself_is_raised_as_it_is() -> None:
    flat = _Flat(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        verify_outputs(flat, (torch.randn(4, 4),), ((torch.zeros(4, 2),), {}), "fx")


class _FrozenStem(nn.Module):
    """Its stem runs under no_grad, which symbolic tracing does not record."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        self.frozen = frozen
        self.stem = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> tuple[Tensor]:
        with torch.set_grad_enabled(not self.frozen):
            h = self.stem(x)
        return (self.head(h),)


def test_the_gradients_of_a_faithful_graph_pass() -> None:
    model = _FrozenStem(frozen=False)
    graph = fx.symbolic_trace(model).graph
    verify_gradients(model, model, graph, (torch.randn(3, 4),), "fx")


def test_a_lost_no_grad_region_is_a_gradient_mismatch_naming_the_parameter() -> None:
    model = _FrozenStem()
    graph = fx.symbolic_trace(model).graph  # the stem now trains
    with pytest.raises(GradientMismatch) as info:
        verify_gradients(model, model, graph, (torch.randn(3, 4),), "fx")
    assert isinstance(info.value, ValueError)  # the tracer tries the next method
    message = str(info.value)
    assert message.startswith("stem.weight receives a gradient in the fx graph, unlike in")
    assert "lost a grad-mode region" in message
