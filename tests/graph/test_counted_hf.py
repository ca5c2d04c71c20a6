"""Hugging Face models traced into units count, unit by unit, the bytes they measure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.graph.sequential import unit_sequential
from profiler.measure import profile_layers
from tests.support.counted import byte_differences, counted_and_measured

transformers = pytest.importorskip("transformers")

_SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
_HEADS = {"num_attention_heads": 4}
_T5 = {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2, "vocab_size": 50}

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _ids(length: int = 8) -> Tensor:
    return torch.randint(0, 50, (4, length), generator=torch.Generator().manual_seed(1))


def _gpt2() -> Built:
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config), (_ids(),), {}


def _llama() -> Built:
    config = transformers.LlamaConfig(
        **_SMALL, **_HEADS, num_key_value_heads=2, vocab_size=50, max_position_embeddings=32
    )
    return transformers.LlamaForCausalLM(config), (_ids(),), {}


def _bert() -> Built:
    config = transformers.BertConfig(**_SMALL, **_HEADS, vocab_size=50)
    mask = (torch.arange(8) < torch.tensor([[8], [6], [5], [3]])).long()  # padded rows
    return transformers.BertForSequenceClassification(config), (_ids(),), {"attention_mask": mask}


def _t5_encoder() -> Built:
    return transformers.T5EncoderModel(transformers.T5Config(**_T5)), (_ids(),), {}


def _t5() -> Built:
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**_T5))
    return model, (_ids(),), {"decoder_input_ids": _ids(6)}


def _vit() -> Built:
    config = transformers.ViTConfig(**_SMALL, **_HEADS, image_size=16, patch_size=4)
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return transformers.ViTForImageClassification(config), (images,), {}


ZOO: dict[str, Callable[[], Built]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "bert-mask": _bert,
    "t5-encoder": _t5_encoder,
    "t5": _t5,
    "vit": _vit,
}


@pytest.mark.parametrize("name", list(ZOO))
def test_units_count_what_they_measure(name: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = ZOO[name]()
    layers, flat = unit_sequential(model, args, kwargs=kwargs)
    counted, measured = counted_and_measured(layers, tuple(flat), batch_sizes=[2, 4])
    assert byte_differences(counted, measured) == {}
    assert len(layers) >= 4
    assert all(layer.flops is not None for layer in measured.layers)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_units_count_what_they_measure_under_autocast(name: str) -> None:
    # Under bfloat16 autocast the CPU's layer norms keep float32 statistics.
    torch.manual_seed(0)
    model, args, kwargs = ZOO[name]()
    layers, flat = unit_sequential(model, args, kwargs=kwargs)
    counted, measured = counted_and_measured(
        layers, tuple(flat), batch_sizes=[2, 4], autocast="bfloat16"
    )
    assert byte_differences(counted, measured) == {}


_COUNTS = ("flops", "backward_flops", "backward_input_flops", "traffic", "backward_traffic")


def test_meta_gpt2_counts_and_measures_as_the_real_one() -> None:
    torch.manual_seed(0)
    model, args, _ = _gpt2()
    with torch.device("meta"):
        empty, _, _ = _gpt2()
    real, flat = unit_sequential(model, args)
    meta, meta_flat = unit_sequential(empty, args)
    assert not any(t.is_meta for t in meta_flat)
    sizes = [2, 4]
    counted = profile_layers(list(real), tuple(flat), batch_sizes=sizes, measure=False)
    on_meta = profile_layers(list(meta), tuple(flat), batch_sizes=sizes, measure=False)
    measured = profile_layers(list(meta), tuple(flat), batch_sizes=sizes, warmup=0, repeats=1)
    assert byte_differences(on_meta, counted) == {}
    assert byte_differences(measured, counted) == {}
    for ours, theirs in zip(on_meta.layers, counted.layers, strict=True):
        assert [getattr(ours, f) for f in _COUNTS] == [getattr(theirs, f) for f in _COUNTS]
    # The tied head and embedding are listed the same either way.
    assert [t.layers for t in on_meta.tied] == [t.layers for t in counted.tied] != []
