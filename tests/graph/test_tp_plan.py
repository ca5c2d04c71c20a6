"""Tests of autopipe.graph.tp_plan: plans read, matched to modules, given to each unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from autopipe.graph.sequential import unit_sequential
from autopipe.graph.tp_plan import (
    check_tp_plan,
    model_tp_plan,
    module_styles,
    read_tp_plan,
    shard_styles,
)
from profiler.measure import profile_layers


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_rep"}


def test_styles_follow_the_patterns_into_each_unit() -> None:
    model = Net()
    layers, _ = unit_sequential(model, (torch.randn(2, 4),))
    styles = shard_styles(model, list(layers), PLAN)
    assert styles is not None and len(styles) == len(layers)
    owner = {id(p): n for n, p in model.named_parameters()}
    found = {
        owner[id(p)]: style[local]
        for layer, style in zip(layers, styles, strict=True)
        for local, p in layer.named_parameters()
        if local in style
    }
    assert found == {
        "blocks.0.up.weight": "colwise",
        "blocks.0.up.bias": "colwise",
        "blocks.0.down.weight": "rowwise",
        "blocks.0.down.bias": "rowwise",
        "blocks.1.up.weight": "colwise",
        "blocks.1.up.bias": "colwise",
        "blocks.1.down.weight": "rowwise",
        "blocks.1.down.bias": "rowwise",
        "head.weight": "colwise_rep",
        "head.bias": "colwise_rep",
    }


def test_a_block_style_covers_the_modules_inside() -> None:
    model = Net()
    plan = {"blocks.0": "local", "blocks.0.norm": "replicate"}
    styles = shard_styles(model, [model.blocks[0]], plan)
    assert styles == [
        {
            "up.weight": "local",
            "up.bias": "local",
            "down.weight": "local",
            "down.bias": "local",
            "norm.weight": "replicate",
            "norm.bias": "replicate",
        }
    ]


def test_an_exact_name_wins_over_a_pattern_at_one_depth() -> None:
    model = Net()
    plan = {"blocks.*.up": "colwise", "blocks.1.up": "replicate", "blocks.1": "gather"}
    styles = module_styles(model, plan)
    assert styles["blocks.0.up"] == "colwise"
    assert styles["blocks.1.up"] == "replicate"  # whatever the plan's order
    assert styles["blocks.1.down"] == "gather"  # the nearest named ancestor's
    assert "blocks.0.down" not in styles and "head" not in styles
    (counted,) = shard_styles(model, [model], plan) or [{}]
    assert counted["blocks.1.up.weight"] == "replicate"
    assert counted["blocks.0.up.weight"] == "colwise"


def test_without_a_plan_there_are_no_styles() -> None:
    model = Net()
    assert model_tp_plan(model) is None
    assert shard_styles(model, [model]) is None


def test_a_pattern_that_matches_nothing_is_one_line() -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"pattern 'blocks\.\*\.gate' matches no module of Net"):
        shard_styles(model, [model], {"blocks.*.gate": "colwise"})


def test_an_unknown_style_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"gives 'head' the unknown style 'diagonal'; use one of"):
        check_tp_plan({"head": "diagonal"})
    with pytest.raises(ValueError, match="must map module-name patterns to style names"):
        check_tp_plan(["head"])


def test_read_tp_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    assert read_tp_plan(path) == PLAN
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"plan\.json is not JSON"):
        read_tp_plan(path)
    with pytest.raises(ValueError, match="cannot read the tensor-parallel plan"):
        read_tp_plan(tmp_path / "missing.json")


def test_config_plan_under_the_base_prefix() -> None:
    class Config:
        def __init__(self) -> None:
            self.base_model_tp_plan = {"blocks.*.up": "colwise"}

    class Wrapper(nn.Module):
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.model = Net()
            self.config = Config()

    assert model_tp_plan(Wrapper()) == {"model.blocks.*.up": "colwise"}


transformers = pytest.importorskip("transformers")
from tests.support.hf_models import llama  # noqa: E402


def test_llama_plan_counts_the_same_on_meta_and_from_real_weights() -> None:
    torch.manual_seed(0)
    model, args, _ = llama()
    with torch.device("meta"):
        empty, _, _ = llama()
    assert model_tp_plan(model) == dict(model._tp_plan)
    assert model_tp_plan(model)["model.layers.*.self_attn.q_proj"] == "colwise"
    real, flat = unit_sequential(model, args)
    meta, _ = unit_sequential(empty, args)
    profiles = [
        profile_layers(
            list(layers),
            tuple(flat),
            batch_sizes=[2, 4],
            measure=False,
            shard_styles=shard_styles(owner, list(layers)),
        )
        for owner, layers in ((model, real), (empty, meta))
    ]
    counted, on_meta = ([layer.shards for layer in p.layers] for p in profiles)
    assert counted == on_meta
    blocks = [s for s in counted if s is not None and s.attention_calls]
    assert len(blocks) == 2
    config = model.config
    for block in blocks:
        assert (block.heads, block.kv_heads) == (4, 2)
        assert block.reductions == 2  # the attention's and the MLP's row-wise outputs
        per_token = 4 * config.hidden_size  # float32 hidden states, whole
        assert block.reduce_forward == [2 * b * 8 * per_token for b in (2, 4)]
        assert block.reduce_backward == block.reduce_forward
        assert block.param_bytes == 4 * sum(
            p.numel()
            for n, p in model.model.layers[0].named_parameters()
            if "proj" in n  # every projection; the norms stay replicated
        )
