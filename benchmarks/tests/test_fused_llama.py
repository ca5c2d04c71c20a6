"""The fused-kernel Llama trains as Hugging Face's and keeps less for backward."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.planning.fused_llama import _rms_norm, _swiglu, fuse

transformers = pytest.importorskip("transformers")


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=224,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def test_fused_operators_have_exact_gradients() -> None:
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _rms_norm(a, b, 1e-6)[0], (x, w))
    gate = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_swiglu, (gate, up))


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(ids, labels=ids).loss
    return loss, sum(seen.values())


def test_fused_model_trains_as_the_eager_one_and_saves_less() -> None:
    eager = _tiny()
    fused = fuse(copy.deepcopy(eager))
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in eager.named_parameters()]
    ids = torch.randint(0, 100, (2, 16))
    loss, eager_saved = _saved_bytes(eager, ids)
    fused_loss, fused_saved = _saved_bytes(fused, ids)
    loss.backward()
    fused_loss.backward()
    # Both compute the norm in float32; only the order of a few float32 operations differs.
    assert float(fused_loss) == pytest.approx(float(loss), rel=1e-6)
    for (name, p), q in zip(eager.named_parameters(), fused.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    assert fused_saved < 0.9 * eager_saved


def test_fused_model_attends_causally_without_a_mask() -> None:
    from autopipe.graph import unit_sequential

    eager = _tiny()
    fused = fuse(copy.deepcopy(eager))
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, eager(ids).logits)
    # Traced, the eager model passes its blocks a 16 × 16 mask; the fused one passes none.
    for model, masks in ((eager, 1), (fused, 0)):
        units, flat = unit_sequential(model, ids)
        value = flat
        shapes = set()
        for unit in units:
            shapes |= {tuple(t.shape[-2:]) for t in value if t.dim() == 4}
            value = unit(*value)
        assert len(shapes & {(16, 16)}) == masks
