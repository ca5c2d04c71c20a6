"""The megatron export as Megatron reads it: its layout parser, layer counts and offsets.

Every command line of the export, parsed with Megatron-LM's flags
(:mod:`tests.support.megatron_arguments`), becomes Megatron-core's own ``TransformerConfig``; its
``get_num_layers_to_build`` and ``get_transformer_layer_offset`` then place each rank's
virtual stages, which must hold exactly the plan's decoder layers.
"""

from __future__ import annotations

import importlib.util
import random
import re
from typing import Any
from unittest import mock

import pytest

from autopipe import Plan
from tests.support.export_cases import named_plan
from tests.support.megatron_arguments import command_lines, transformer_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)


def _names(layers: int) -> list[str]:
    """A GPT-2 of ``layers`` decoder layers: embeddings before, final norm and head after."""
    return ["wte", "wpe", *(f"h.{i}" for i in range(layers)), "ln_f", "lm_head"]


def _plan(counts: list[int], virtual: int) -> Plan:
    """A plan whose stages hold ``counts`` decoder layers, the embedding and loss units
    added to the first and last stage."""
    balance = list(counts)
    balance[0] += 2
    balance[-1] += 2
    return named_plan(_names(sum(counts)), balance, virtual)


def _random_counts(rng: random.Random) -> tuple[list[int], int]:
    """Decoder layers per stage of K ranks times v, half of them of Megatron's first/last
    form (middle ranks equal, each rank's stages equal), the first or last sometimes 0."""
    ranks, virtual = rng.randint(2, 5), rng.randint(1, 3)
    if rng.random() < 0.5:
        per_rank = [rng.randint(0, 3), *[rng.randint(1, 3)] * (ranks - 2), rng.randint(0, 3)]
        counts = [per_rank[s % ranks] for s in range(ranks * virtual)]
    else:
        counts = [rng.randint(0, 4) for _ in range(ranks * virtual)]
    for s in range(1, ranks * virtual - 1):  # a stage in the middle holds some unit
        counts[s] = max(counts[s], 1)
    counts[-1] += max(0, 2 - sum(counts))  # a stack of layers: two at least
    return counts, virtual


def _megatron_placement(config: Any) -> list[tuple[int, int]]:
    """(offset, layers) of every stage in the plan's order, stage r + j·K on rank r, as
    Megatron computes them from its ``TransformerConfig``."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    ranks = config.pipeline_model_parallel_size
    virtual = config.virtual_pipeline_model_parallel_size  # set from a layout too
    placement: dict[int, tuple[int, int]] = {}
    for rank in range(ranks):
        for j in range(virtual or 1):
            vp_stage = j if virtual else None
            with (
                mock.patch.object(
                    parallel_state, "get_pipeline_model_parallel_rank", return_value=rank
                ),
                mock.patch.object(
                    parallel_state,
                    "get_virtual_pipeline_model_parallel_world_size",
                    return_value=virtual,
                ),
            ):
                layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)
                offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
            placement[j * ranks + rank] = (offset, layers)
    return [placement[s] for s in sorted(placement)]


def _plan_placement(plan: Plan) -> list[tuple[int, int]]:
    """(offset, layers) of every stage: its first decoder layer's index and their count."""
    placement, offset = [], 0
    for stage in plan.stages:
        held = [int(m.group(1)) for n in stage.layers if (m := re.fullmatch(r"h\.(\d+)", n))]
        assert held == list(range(offset, offset + len(held)))
        placement.append((offset, len(held)))
        offset += len(held)
    return placement


def test_megatron_places_every_exported_plans_layers_as_the_plan() -> None:
    rng = random.Random(0)
    forms = {"layout": 0, "first/last": 0, "virtual first/last": 0}
    for _ in range(80):
        counts, virtual = _random_counts(rng)
        plan = _plan(counts, virtual)
        lines = command_lines(plan.export("megatron"))
        assert lines[0].pipeline_model_parallel_layout and len(lines) <= 2
        for arguments in lines:
            placed = _megatron_placement(transformer_config(arguments))
            assert placed == _plan_placement(plan), (counts, arguments)
        if len(lines) == 2:
            forms["virtual first/last" if virtual > 1 else "first/last"] += 1
        forms["layout"] += 1
    assert min(forms.values()) >= 5, forms  # every form was checked on several plans


def test_two_ranks_with_virtual_stages_export_the_layout_only() -> None:
    plan = _plan(
        [2, 1, 1, 2], virtual=2
    )  # balance [4, 2, 2, 4]: first/last counts 4 and 4 would describe it
    text = plan.export("megatron")
    assert "--decoder-first-pipeline-num-layers" not in text
    assert "Megatron needs a middle rank" in text
    (arguments,) = command_lines(text)
    assert _megatron_placement(transformer_config(arguments)) == [(0, 2), (2, 1), (3, 1), (4, 2)]
