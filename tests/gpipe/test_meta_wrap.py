"""wrap() of models built on the meta device: each stage materialized on its own device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.gpipe.wrapping import WrappedPipeline, wrap
from autopipe.graph.meta import has_meta_state
from tests.support.float64 import assert_close64, square_loss
from tests.support.meta_models import build, gpt2, llama, load_from, token_ids
from tests.support.wrap_models import ResidualMLP

pytest.importorskip("transformers")

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


pytestmark = pytest.mark.usefixtures("float64")  # float64 as the default dtype


def _trains_alike(wrapped: nn.Module, reference: nn.Module, x: Tensor, steps: int = 2) -> None:
    """Outputs, gradients and ``steps`` SGD steps of the two models agree."""
    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in wrapped.named_parameters()] == names
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, reference)]
    for _ in range(steps):
        losses = []
        for model, optimizer in zip((wrapped, reference), optimizers):
            optimizer.zero_grad()
            loss = square_loss(model(x))
            loss.backward()
            losses.append(loss.detach())
        assert_close64(losses[0], losses[1])
        grads = dict(reference.named_parameters())
        for name, param in wrapped.named_parameters():
            assert_close64(param.grad, grads[name].grad)
        for optimizer in optimizers:
            optimizer.step()
    assert_close64(dict(wrapped.state_dict()), dict(reference.state_dict()))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor]]] = {
    "mlp": (ResidualMLP, lambda: torch.randn(8, 5)),
    "gpt2": (lambda: gpt2(**NO_DROPOUT), token_ids),
    "llama": (llama, token_ids),
}


def _wrap(model: nn.Module, x: Tensor, **options: Any) -> WrappedPipeline:
    return wrap(model, x, devices=["cpu", "cpu"], chunks=2, **options)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_meta_model_loaded_per_stage_trains_like_the_real_one(case: str) -> None:
    factory, sample = CASES[case]
    reference = build(factory, meta=False, seed=3)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    parts: list[list[str]] = []

    def init(part: nn.Module) -> None:
        parts.append(sorted(part.state_dict()))
        load_from(state)(part)

    model = build(factory, meta=True)
    x = sample()
    wrapped = _wrap(model, x, init=init)
    assert not has_meta_state(model)
    # One call per stage, each with its own tensors only, together the whole model.
    assert len(parts) == 2 and not set(parts[0]) & set(parts[1])
    assert set(parts[0]) | set(parts[1]) == set(state)
    stage_keys = [
        {n for p in partition.parameters() for n, q in model.named_parameters() if q is p}
        for partition in wrapped.pipeline.partitions
    ]
    assert stage_keys[1] - set(parts[0]) <= set(parts[1])
    _trains_alike(wrapped, reference, x)


def test_gpt2s_head_stays_tied_to_its_embedding_through_a_copy() -> None:
    factory = lambda: gpt2(**NO_DROPOUT)  # noqa: E731
    reference = build(factory, meta=False, seed=3)
    model: Any = build(factory, meta=True)
    x = token_ids()
    init = load_from(reference.state_dict())
    wrapped = _wrap(model, x, init=init, replicate_shared=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    # The head's stage reads a copy of the first stage's embedding.
    assert wrapped.replicated == {"transformer.wte.weight": (0, 1)}
    _trains_alike(wrapped, reference, x)


def test_without_init_the_models_own_initializers_run_per_stage() -> None:
    model: Any = build(llama, meta=True)
    x = token_ids()
    wrapped = _wrap(model, x)
    assert not has_meta_state(model)
    # Hugging Face's initializer ran: norms at one, rotary frequencies computed.
    assert bool((model.model.norm.weight == 1).all())
    real: Any = build(llama, meta=False)
    assert_close64(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    # It trains like the plain model holding the same values.
    real.load_state_dict(wrapped.state_dict())
    _trains_alike(wrapped, real, x)


class Scaled(nn.Module):
    """A parameter of its own, which no initializer knows."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) * self.scale)


def test_a_tensor_nothing_initializes_is_refused_unless_init_is_given() -> None:
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"nothing initializes scale .*pass init="):
        _wrap(build(Scaled, meta=True), x)

    def ones(part: nn.Module) -> None:
        for name, param in part.named_parameters():
            if name == "scale":
                param.fill_(1.0)

    model: Any = build(Scaled, meta=True)
    wrapped = _wrap(model, x, init=ones)
    assert_close64(model.scale, torch.ones(4))
    assert wrapped(x).shape == (8, 4)


def test_init_is_refused_for_a_model_without_meta_tensors() -> None:
    with pytest.raises(ValueError, match=r"init= .*none on meta"):
        _wrap(ResidualMLP(), torch.randn(8, 5), init=lambda part: None)


def test_a_stage_larger_than_the_free_memory_is_refused_before_any_is_materialized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import profiler.memory_guard
    from profiler.profile import Profile

    x = torch.randn(8, 5)
    real = wrap(ResidualMLP(), x, devices=["cpu", "cpu"], chunks=2)
    profile = Profile.from_dict(real.plan.profile)  # so that nothing is measured below
    balance = real.plan.balance
    model: Any = build(ResidualMLP, meta=True)
    sizes = [
        sum(t.numel() * t.element_size() for t in unit.state_dict().values())
        for unit in real.pipeline
    ]
    first = sum(sizes[: balance[0]])
    # Stage 0 fits 80% of this figure; stages 0 and 1 together on the one CPU do not.
    free = int(first / 0.8) + 1
    monkeypatch.setattr(profiler.memory_guard, "free_bytes", lambda device: free)
    with pytest.raises(ValueError) as caught:
        _wrap(model, x, profile=profile)
    message = str(caught.value)
    assert message.startswith("materializing stage 1 (layers ")
    assert " on cpu for its " in message and "of earlier stages there" in message
    assert "free memory there" in message and "\n" not in message
    assert has_meta_state(model) and all(t.is_meta for t in model.state_dict().values())
    monkeypatch.setattr(profiler.memory_guard, "free_bytes", lambda device: None)
    assert _wrap(model, x, profile=profile)(x).shape == (8, 3)  # unreadable: not refused
