"""Input shapes of wrapped models: export's fixed sizes refused clearly, ``dynamic=`` dims vary."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.gpipe.wrapping import WrappedPipeline, wrap
from autopipe.graph.tracing import TracingError

pytestmark = pytest.mark.usefixtures("float64")  # float64 as the default dtype


class SequenceBranch(nn.Module):
    """Takes another path for long sequences: export evaluates the branch once."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        if x.shape[1] > 12:
            h = h * 2
        return self.second(h)


class EvenBranch(nn.Module):
    """Branches on a condition that is not a range of sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        if x.shape[1] % 2 == 0:
            h = h + 1
        return self.second(h)


class BatchBranch(nn.Module):
    """Branches on the batch size, which the pipeline changes to the micro-batch's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        if x.shape[0] > 4:
            h = h * 3
        return self.second(h)


class FixedWidth(nn.Module):
    """Reshapes with a hard-coded sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(64, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x).reshape(-1, 64))


class ShapeReshape(nn.Module):
    """Reads the sequence length in one unit and uses it in another, as torch.fx records."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        length = x.size(1)
        h = self.c(self.b(self.a(x)))
        positions = torch.arange(length * 2, dtype=h.dtype).reshape(1, -1, 1)
        return h.reshape(x.shape[0], length * 2, 2) + positions


class TwoInputs(nn.Module):
    """Adds two inputs, so their sequence lengths must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.second(self.first(x) + y)


class Regroup(nn.Module):
    """Regroups one input's sequence into another's: export ties their lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.second(self.first(x.reshape(x.shape[0], -1, 4)) + y)


def _llama(layers: int = 2) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _tokens(length: int, batch: int = 4) -> Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(length))


def _wrap(model: nn.Module, x: Tensor, **options: Any) -> WrappedPipeline:
    return wrap(model, (x,), stages=2, chunks=2, method="export", **options)


def test_other_sequence_length_of_a_hugging_face_model_is_refused_clearly() -> None:
    model = _llama()
    wrapped = wrap(model, (), kwargs={"input_ids": _tokens(16)}, stages=2, chunks=2)
    assert wrapped.method == "export"
    message = (
        r"input 'input_ids' has shape \(4, 12\) but the model was traced at \(4, 16\) with "
        r"only the batch dimension free; pass dynamic=\{'input_ids': 1\} to wrap\(\)"
    )
    with pytest.raises(ValueError, match=message):
        wrapped(input_ids=_tokens(12))
    torch.testing.assert_close(
        wrapped(input_ids=_tokens(16, batch=6)).logits, model(input_ids=_tokens(16, batch=6)).logits
    )


def test_positional_inputs_are_named_after_the_forward_parameter() -> None:
    wrapped = _wrap(SequenceBranch(), torch.randn(8, 16, 4))
    with pytest.raises(ValueError, match=r"input 'x' has shape \(8, 12, 4\) .*\{'x': 1\}"):
        wrapped(torch.randn(8, 12, 4))
    with pytest.raises(ValueError, match=r"\(8, 16\) .*\(8, 16, 4\): pass a tensor of 3 dims"):
        wrapped(torch.randn(8, 16))


def test_a_shape_branch_never_takes_the_wrong_path() -> None:
    model = SequenceBranch()
    reference = copy.deepcopy(model)
    fixed = _wrap(model, torch.randn(8, 16, 4))
    dynamic = _wrap(copy.deepcopy(reference), torch.randn(8, 16, 4), dynamic={"x": 1})
    for length in range(2, 21):
        x = torch.randn(8, length, 4)
        for wrapped in (fixed, dynamic):
            try:
                output = wrapped(x)
            except ValueError:
                assert wrapped is fixed or length <= 12
                continue
            torch.testing.assert_close(output, reference(x))
            assert wrapped is dynamic or length == 16
    with pytest.raises(ValueError, match="dim 1 of input 'x' is 12, .*sizes 13 and up"):
        dynamic(torch.randn(8, 12, 4))
    x = torch.randn(8, 30, 4)
    torch.testing.assert_close(dynamic(x), reference(x))


def test_a_condition_on_shapes_that_is_no_range_is_checked() -> None:
    model = EvenBranch()
    reference = copy.deepcopy(model)
    wrapped = _wrap(model, torch.randn(8, 16, 4), dynamic={0: [1]})
    x = torch.randn(8, 10, 4)
    torch.testing.assert_close(wrapped(x), reference(x))
    with pytest.raises(ValueError, match="condition on shapes .*'x'"):
        wrapped(torch.randn(8, 11, 4))


def test_a_branch_on_the_batch_size_follows_the_mini_batch() -> None:
    model = BatchBranch()
    reference = copy.deepcopy(model)
    # The micro-batches of 4 run the path of the whole mini-batch, as the plain model does.
    wrapped = _wrap(model, torch.randn(8, 16, 4))
    for batch in (8, 6):
        x = torch.randn(batch, 16, 4)
        torch.testing.assert_close(wrapped(x), reference(x))
    with pytest.raises(ValueError, match=r"condition on shapes .*'x'.size\(\)\[0\] >= 5"):
        wrapped(torch.randn(4, 16, 4))


def test_sizes_export_ties_must_agree() -> None:
    model = TwoInputs()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16, 4), torch.randn(8, 16, 4)
    wrapped = wrap(model, (x, y), stages=2, chunks=2, method="export", dynamic={"x": 1, "y": [1]})
    x, y = torch.randn(8, 5, 4), torch.randn(8, 5, 4)
    torch.testing.assert_close(wrapped(x, y), reference(x, y))
    # Broadcasting would run it, with another result than the plain model's error.
    with pytest.raises(ValueError, match="dim 1 of input 'y' is 1 but dim 1 of input 'x' is 5"):
        wrapped(x, torch.randn(8, 1, 4))


def test_sizes_a_reshape_ties_must_agree() -> None:
    model = Regroup()
    reference = copy.deepcopy(model)
    sample = (torch.randn(8, 32, 2), torch.randn(8, 16, 4))
    wrapped = wrap(model, sample, stages=2, chunks=2, method="export", dynamic={"x": 1, "y": 1})
    x, y = torch.randn(6, 10, 2), torch.randn(6, 5, 4)
    torch.testing.assert_close(wrapped(x, y), reference(x, y))
    with pytest.raises(ValueError, match=r"condition on shapes .*'x'.size\(\)\[1\] // 2"):
        wrapped(torch.randn(6, 10, 2), torch.randn(6, 4, 4))


def test_a_given_dim_range_is_kept() -> None:
    model = SequenceBranch()
    with pytest.raises(TracingError, match="Constraints violated"):  # the branch narrows it
        _wrap(model, torch.randn(8, 16, 4), dynamic={"x": {1: torch.export.Dim("s", min=4)}})
    seq = torch.export.Dim("seq", min=13, max=32)
    wrapped = _wrap(model, torch.randn(8, 16, 4), dynamic={"x": {1: seq}})
    x = torch.randn(8, 32, 4)
    torch.testing.assert_close(wrapped(x), copy.deepcopy(model)(x))
    with pytest.raises(ValueError, match="dim 1 of input 'x' is 33, .*sizes 13 to 32"):
        wrapped(torch.randn(8, 33, 4))


def test_dtype_baked_in_by_export_is_checked() -> None:
    wrapped = _wrap(SequenceBranch(), torch.randn(8, 16, 4))
    with pytest.raises(ValueError, match="input 'x' has dtype torch.float32 but .*torch.float64"):
        wrapped(torch.randn(8, 16, 4, dtype=torch.float32))


def test_a_dim_the_code_fixes_cannot_be_declared_dynamic() -> None:
    with pytest.raises(TracingError, match="dim 1 of input x was declared dynamic, .* at 16"):
        _wrap(FixedWidth(), torch.randn(8, 16, 4), dynamic={"x": 1})


@pytest.mark.parametrize(
    ("dynamic", "message"),
    [
        ({"y": 1}, "names the input 'y', but the model's tensor inputs are 'x'"),
        ({"x": 3}, "names dim 3, but input 'x' has 3 dims"),
        ({"x": "seq"}, "must be a dim, a list of dims or a mapping"),
        ({"x": [1.5]}, "names the dim 1.5"),
        ([1], "must map input names to the dims that vary"),
    ],
)
def test_bad_dynamic_is_refused(dynamic: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _wrap(SequenceBranch(), torch.randn(8, 16, 4), dynamic=dynamic)


def test_fx_keeps_shapes_symbolic() -> None:
    model = ShapeReshape()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, (torch.randn(8, 16, 4),), stages=3, chunks=2, granularity="children")
    assert wrapped.method == "fx" and wrapped.plan.balance == [1, 1, 1]
    for length in (16, 7):
        x = torch.randn(6, length, 4)
        torch.testing.assert_close(wrapped(x), reference(x))


def test_dynamic_sequence_trains_like_the_plain_model_at_two_lengths() -> None:
    model = _llama()
    reference = copy.deepcopy(model)
    wrapped = wrap(
        model,
        (),
        kwargs={"input_ids": _tokens(16)},
        stages=2,
        chunks=2,
        dynamic={"input_ids": 1},
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, reference)]
    for length in (16, 9):
        tokens = _tokens(length)
        outputs = []
        for module, optimizer in zip((wrapped, reference), optimizers):
            optimizer.zero_grad()
            logits = module(input_ids=tokens).logits
            logits.square().mean().backward()
            outputs.append(logits)
        torch.testing.assert_close(outputs[0], outputs[1])
        for (name, a), b in zip(wrapped.named_parameters(), reference.parameters()):
            assert a.grad is not None and b.grad is not None, name
            torch.testing.assert_close(a.grad, b.grad)
        for optimizer in optimizers:
            optimizer.step()
    for a, b in zip(wrapped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)
