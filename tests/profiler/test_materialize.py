"""materialize / materialize_part: meta tensors given storage, initialized as the model would be."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from profiler.materialize import has_meta, materialize, materialize_part, meta_tensors
from tests.support.meta_models import build, gpt2, llama
from tests.support.wrap_models import ResidualMLP

pytest.importorskip("transformers")


def test_hugging_face_models_start_as_their_own_initializer_starts_them() -> None:
    model: Any = build(llama, meta=True)
    materialize(model, "cpu")
    real: Any = build(llama, meta=False)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    assert bool((model.model.layers[0].input_layernorm.weight == 1).all())
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # the config's initializer_range, not nn.Linear's own


def test_a_part_holds_only_its_tensors_under_the_models_names() -> None:
    model: Any = build(gpt2, meta=True)
    names = [n for n in meta_tensors(model) if n.startswith("transformer.h.1.")]
    part = materialize_part(model, names, "cpu", strict=True)
    assert sorted(part.state_dict()) == sorted(names)
    assert part.get_submodule("transformer.h.1") is model.transformer.h[1]  # the real block
    assert has_meta(model) and not has_meta(model.transformer.h[1])
    assert model.transformer.h[0].attn.c_attn.weight.is_meta  # the rest is left alone


def test_a_tied_tensor_is_materialized_once_under_both_names() -> None:
    model: Any = build(gpt2, meta=True)
    part = materialize_part(model, ["lm_head.weight"], "cpu")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not model.lm_head.weight.is_meta
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(part.state_dict())


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))


def test_strict_refuses_a_tensor_nothing_writes_and_init_can_write_it() -> None:
    names = ["a.weight", "a.bias", "scale"]
    with pytest.raises(ValueError, match=r"^nothing initializes scale \(.*pass init="):
        materialize_part(build(Scaled, meta=True), names, "cpu", strict=True)

    def twos(part: nn.Module) -> None:
        part.get_parameter("scale").fill_(2.0)

    model: Any = build(Scaled, meta=True)
    materialize_part(model, ["scale"], "cpu", twos, strict=True)
    torch.testing.assert_close(model.scale, torch.full((4,), 2.0))
    assert model.a.weight.is_meta


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="blocks.9.up.weight is not a parameter or buffer"):
        materialize_part(build(ResidualMLP, meta=True), ["blocks.9.up.weight"], "cpu")


def test_the_same_seed_gives_the_same_values() -> None:
    first, second = build(ResidualMLP, meta=True), build(ResidualMLP, meta=True)
    materialize(first, "cpu", seed=5)
    materialize(second, "cpu", seed=5)
    for a, b in zip(first.parameters(), second.parameters()):
        torch.testing.assert_close(a, b)
