"""Hugging Face architectures from small configs with their default settings, for tests.

Each builder returns the model, its positional inputs and its keyword inputs; ``transformers``
must be importable (the tests that use them skip without it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import Tensor, nn

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]

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


def ids(length: int = 8) -> Tensor:
    return torch.randint(0, 50, (4, length), generator=torch.Generator().manual_seed(1))


def gpt2() -> Built:
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config), (ids(),), {}


def llama(**config: Any) -> Built:
    """A small Llama; ``config`` overrides its fields."""
    fields = {
        **_SMALL, **_HEADS, "num_key_value_heads": 2, "vocab_size": 50,
        "max_position_embeddings": 32, **config,
    }  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)), (ids(),), {}


def gpt_neox() -> Built:
    config = transformers.GPTNeoXConfig(**_SMALL, **_HEADS, vocab_size=50)
    return transformers.GPTNeoXForCausalLM(config), (ids(),), {}


def t5() -> Built:
    config = transformers.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, vocab_size=50
    )
    model = transformers.T5ForConditionalGeneration(config)
    return model, (ids(),), {"decoder_input_ids": ids(6)}


def bart() -> Built:
    config = transformers.BartConfig(**_SEQ2SEQ, vocab_size=50, max_position_embeddings=32)
    return transformers.BartForConditionalGeneration(config), (ids(),), {}


def bert() -> Built:
    config = transformers.BertConfig(**_SMALL, **_HEADS, vocab_size=50)
    mask = (torch.arange(8) < torch.tensor([[8], [6], [5], [3]])).long()  # padded rows
    model = transformers.BertForSequenceClassification(config)
    return model, (ids(),), {"attention_mask": mask}


def distilbert() -> Built:
    config = transformers.DistilBertConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=4)
    config.vocab_size = 50
    return transformers.DistilBertForSequenceClassification(config), (ids(),), {}


def vit() -> Built:
    config = transformers.ViTConfig(**_SMALL, **_HEADS, image_size=16, patch_size=4)
    return (
        transformers.ViTForImageClassification(config),
        (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)),),
        {},
    )


def swin() -> Built:
    config = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    return transformers.SwinForImageClassification(config), (torch.randn(4, 3, 32, 32),), {}


def whisper_encoder() -> Built:
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


def clip_text() -> Built:
    config = transformers.CLIPTextConfig(
        **_SMALL, **_HEADS, vocab_size=50, max_position_embeddings=16
    )
    return transformers.CLIPTextModel(config), (ids(),), {}


def mamba() -> Built:
    config = transformers.MambaConfig(
        hidden_size=32, state_size=4, num_hidden_layers=2, vocab_size=50
    )
    return transformers.MambaForCausalLM(config), (ids(),), {}


def deberta_v2(layers: int = 4) -> Built:
    """DeBERTa-v2's encoder with relative attention: every layer reads the one
    ``encoder.rel_embeddings`` weight (no norm on it, so the parameter itself, not a value
    computed once, reaches each layer). No dropout, so that training compares exactly, and
    a larger initialization, so that the shared table gets gradients well above rounding."""
    config = transformers.DebertaV2Config(
        **{**_SMALL, "num_hidden_layers": layers},
        **_HEADS,
        vocab_size=50,
        max_position_embeddings=32,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.2,
    )
    return transformers.DebertaV2Model(config), (ids(),), {}


def falcon() -> Built:
    """Falcon indexes its fused key-value columns with lists (``qkv[..., [-2], :]``), which
    torch.export lifts into constant index tensors."""
    config = transformers.FalconConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=50
    )
    return transformers.FalconForCausalLM(config), (ids(),), {}


def mixtral() -> Built:
    """A sparse mixture of experts; its experts run a grouped GEMM by default."""
    config = transformers.MixtralConfig(
        **_SMALL,
        **_HEADS,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=50,
        max_position_embeddings=32,
    )
    return transformers.MixtralForCausalLM(config), (ids(),), {}


ZOO: dict[str, Callable[[], Built]] = {
    "gpt2": gpt2,
    "llama": llama,
    "gpt-neox": gpt_neox,
    "t5": t5,
    "bart": bart,
    "bert-mask": bert,
    "distilbert": distilbert,
    "vit": vit,
    "swin": swin,
    "whisper-encoder": whisper_encoder,
    "clip-text": clip_text,
    "mamba": mamba,
}
