"""Grad-mode regions of a model's code survive tracing and the cut into stages."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.gpipe.wrapping import wrap
from autopipe.graph.grad_modes import KEY, insert_grad_modes
from autopipe.graph.tracing import TracingError, trace
from tests.support.wrap_models import GRAD_FORMS, GradRegion


def _assert_same_training(wrapped: nn.Module, model: nn.Module, x: Tensor) -> None:
    output, expected = wrapped(x), model(x)
    torch.testing.assert_close(output, expected)
    assert output.requires_grad == expected.requires_grad
    output.square().sum().backward()
    expected.square().sum().backward()
    theirs = dict(model.named_parameters())
    for name, param in wrapped.named_parameters():
        if theirs[name].grad is None:
            assert param.grad is None, f"{name} is trained, but frozen in the model"
        else:
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, theirs[name].grad)


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("form", GRAD_FORMS)
@pytest.mark.parametrize("span", [False, True], ids=["in-one-stage", "across-the-cut"])
def test_regions_train_like_the_model(method: str, form: str, span: bool) -> None:
    torch.manual_seed(0)
    model = GradRegion(form, span)
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    checkpoint = "always" if span else "except_last"
    wrapped = wrap(
        model, (x,), stages=2, chunks=2, method=method, strategy="uniform", checkpoint=checkpoint
    )
    assert wrapped.method == method
    assert wrapped.units == ["stem", "a", "b", "c"] and wrapped.plan.balance == [2, 2]
    _assert_same_training(wrapped, reference, x)
    wrapped.close()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_nodes_carry_the_mode_of_their_region(method: str) -> None:
    traced = trace(GradRegion("enable_grad", span=True), (torch.randn(3, 4),), method=method)
    modes = {}
    for node in traced.graph.nodes:
        if node.op in ("call_module", "call_function") and "nn_module_stack" in node.meta:
            path = list(node.meta["nn_module_stack"].values())[-1][0].split(".")[-1]
            modes.setdefault(path, set()).add(node.meta.get(KEY))
    assert modes["stem"] == {False} and modes["a"] == {True} and modes["b"] == {True}
    assert modes["c"] == {None}  # the caller's mode


def test_graphs_without_regions_are_left_alone() -> None:
    graph = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU())).graph
    before = graph.python_code("self").src
    insert_grad_modes(graph)
    assert graph.python_code("self").src == before


class _RawSwitch(nn.Module):
    """Turns grad off through the private switch, which torch.fx does not see."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        torch._C._set_grad_enabled(False)
        h = self.stem(x)
        torch._C._set_grad_enabled(True)
        return self.head(h)


def test_the_trace_check_compares_which_parameters_get_gradients() -> None:
    model = _RawSwitch()
    wrong = "stem.weight receives a gradient in the fx graph.*Fix: change the grad mode"
    with pytest.raises(TracingError, match=wrong):
        trace(model, (torch.randn(3, 4),), method="fx")
    # export records the switch: auto falls back to it and trains like the model
    reference = copy.deepcopy(model)
    x = torch.randn(4, 4)
    wrapped = wrap(model, (x,), stages=2, strategy="uniform")
    assert wrapped.method == "export"
    _assert_same_training(wrapped, reference, x)
    wrapped.close()


class _EnabledHead(nn.Module):
    """Ends in an enable_grad() block: its output requires grad even under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        with torch.enable_grad():
            return self.head(h)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_an_enable_grad_region_under_the_callers_no_grad(method: str) -> None:
    model = _EnabledHead()
    x = torch.randn(4, 4)
    wrapped = wrap(model, (x,), stages=2, chunks=2, method=method)
    with torch.no_grad():
        output, expected = wrapped(x), model(x)
    assert output.requires_grad and expected.requires_grad
    output.sum().backward()
    assert model.body.weight.grad is None and model.head.weight.grad is not None
    wrapped.close()
