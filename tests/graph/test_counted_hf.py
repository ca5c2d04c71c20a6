"""Hugging Face models traced into units count, unit by unit, the bytes they measure."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from autopipe.graph.sequential import unit_sequential
from profiler.measure import profile_layers
from tests.support.counted import byte_differences, counted_and_measured

transformers = pytest.importorskip("transformers")
from tests.support.hf_models import ZOO as HF_ZOO  # noqa: E402
from tests.support.hf_models import Built, falcon, gpt2, ids  # noqa: E402

_T5 = {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2, "vocab_size": 50}


def _t5_encoder() -> Built:
    return transformers.T5EncoderModel(transformers.T5Config(**_T5)), (ids(),), {}


# The architectures the pipeline tests train, and T5's encoder alone.
ZOO: dict[str, Callable[[], Built]] = {**HF_ZOO, "t5-encoder": _t5_encoder}


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


@pytest.mark.parametrize("build", [gpt2, falcon])
def test_meta_model_counts_and_measures_as_the_real_one(build: Callable[[], Built]) -> None:
    """Falcon's real trace copied its constant index tensors and saved the copies (16 B a
    block more than on meta) until the tracer read the constants themselves."""
    torch.manual_seed(0)
    model, args, _ = build()
    with torch.device("meta"):
        empty, _, _ = build()
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
    assert (
        byte_differences(
            counted, profile_layers(list(real), tuple(flat), batch_sizes=sizes, warmup=0, repeats=1)
        )
        == {}
    )
    # The tied head and embedding are listed the same either way.
    assert [t.layers for t in on_meta.tied] == [t.layers for t in counted.tied] != []
