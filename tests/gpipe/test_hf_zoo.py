"""Hugging Face architectures with their default configs, wrapped into two stages."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from autopipe.gpipe.wrapping import wrap

transformers = pytest.importorskip("transformers")

_SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
_HEADS = {"num_attention_heads": 4}
_SEQ2SEQ = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
}


def _ids(length: int = 8) -> Tensor:
    return torch.randint(0, 50, (4, length))


def _gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(config), (_ids(),), {}


def _llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.LlamaConfig(
        **_SMALL, **_HEADS, num_key_value_heads=2, vocab_size=50, max_position_embeddings=32
    )
    return transformers.LlamaForCausalLM(config), (_ids(),), {}


def _gpt_neox() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.GPTNeoXConfig(**_SMALL, **_HEADS, vocab_size=50)
    return transformers.GPTNeoXForCausalLM(config), (_ids(),), {}


def _t5() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, vocab_size=50
    )
    model = transformers.T5ForConditionalGeneration(config)
    return model, (_ids(),), {"decoder_input_ids": _ids(6)}


def _bart() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.BartConfig(**_SEQ2SEQ, vocab_size=50, max_position_embeddings=32)
    return transformers.BartForConditionalGeneration(config), (_ids(),), {}


def _bert() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.BertConfig(**_SMALL, **_HEADS, vocab_size=50)
    mask = (torch.arange(8) < torch.tensor([[8], [6], [5], [3]])).long()  # padded rows
    model = transformers.BertForSequenceClassification(config)
    return model, (_ids(),), {"attention_mask": mask}


def _distilbert() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.DistilBertConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=4)
    config.vocab_size = 50
    return transformers.DistilBertForSequenceClassification(config), (_ids(),), {}


def _vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.ViTConfig(**_SMALL, **_HEADS, image_size=16, patch_size=4)
    return transformers.ViTForImageClassification(config), (torch.randn(4, 3, 16, 16),), {}


def _swin() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    return transformers.SwinForImageClassification(config), (torch.randn(4, 3, 32, 32),), {}


def _whisper_encoder() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=8,
    )
    return WhisperEncoder(config), (torch.randn(4, 8, 16),), {}


def _clip_text() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.CLIPTextConfig(
        **_SMALL, **_HEADS, vocab_size=50, max_position_embeddings=16
    )
    return transformers.CLIPTextModel(config), (_ids(),), {}


def _mamba() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.MambaConfig(
        hidden_size=32, state_size=4, num_hidden_layers=2, vocab_size=50
    )
    return transformers.MambaForCausalLM(config), (_ids(),), {}


ZOO = {
    "gpt2": _gpt2,
    "llama": _llama,
    "gpt-neox": _gpt_neox,
    "t5": _t5,
    "bart": _bart,
    "bert-mask": _bert,
    "distilbert": _distilbert,
    "vit": _vit,
    "swin": _swin,
    "whisper-encoder": _whisper_encoder,
    "clip-text": _clip_text,
    "mamba": _mamba,
}


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _tensors(output: Any) -> dict[str, Tensor]:
    """The output's tensors by key; the cache is left out (the pipeline traces without)."""
    items = output.items() if isinstance(output, dict) else enumerate(pytree.tree_leaves(output))
    found = {}
    for key, value in items:
        if key == "past_key_values":
            continue
        for i, leaf in enumerate(pytree.tree_leaves(value)):
            if isinstance(leaf, Tensor):
                found[f"{key}.{i}"] = leaf
    return found


# Mamba's reference scan runs in float32 whatever the model's dtype.
_TOLERANCE = {"mamba": {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize("name", list(ZOO))
def test_default_config_trains_like_the_model(name: str) -> None:
    tolerance = _TOLERANCE.get(name, {"rtol": 1e-9, "atol": 1e-10})
    torch.manual_seed(0)
    model, args, kwargs = ZOO[name]()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, args, kwargs=kwargs, stages=2, chunks=2)
    assert len(wrapped.plan.balance) == 2
    assert list(wrapped.state_dict()) == list(reference.state_dict())
    # Default dropout draws differ per micro-batch: compare in evaluation mode.
    wrapped.eval()
    reference.eval()
    ours, theirs = _tensors(wrapped(*args, **kwargs)), _tensors(reference(*args, **kwargs))
    assert ours.keys() == theirs.keys()
    torch.testing.assert_close(ours, theirs, **tolerance)
    sum(t.square().sum() for t in ours.values() if t.is_floating_point()).backward()
    sum(t.square().sum() for t in theirs.values() if t.is_floating_point()).backward()
    grads = dict(reference.named_parameters())
    for key, param in wrapped.named_parameters():
        expected = grads[key].grad
        if expected is None:
            assert param.grad is None, key
        else:
            assert param.grad is not None, key
            torch.testing.assert_close(param.grad, expected, **tolerance)
    wrapped.close()
