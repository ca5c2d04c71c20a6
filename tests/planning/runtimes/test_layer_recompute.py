"""Plans re-computing some units, as the Megatron and torchtitan exports write them.

Megatron's flags are parsed back with Megatron-LM's flag names into megatron-core's
``TransformerConfig``, and the layers its block method checkpoints are read from the
exported layout with megatron-core's own parser: they must cover the planned ones, and
every layer more than planned must come with a note. torchtitan's settings load through
torchtitan 0.3.0's ConfigManager.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
from typing import Any

import pytest

from autopipe import Plan
from autopipe.planning import plan as make_plan
from tests.support.mesh_plans import MeshCase, mesh_plan
from tests.support.planning_cases import linear_profile
from tests.support.tomlfile import read_toml

# A Llama of 16 decoder layers: units 1..16 are layers.0..15.
LLAMA = ["tok_embeddings", *(f"layers.{i}" for i in range(16)), "norm", "output"]
# Stage 0: the embedding and layers 0-3; 1: layers 4-7; 2: layers 8-11; 3: layers 12-15
# with the loss (units 13-16, then 17 and 18).
BALANCE = (5, 4, 4, 6)

Modes = dict[int, list[int] | str]


def _plan(modes: Modes, balance: tuple[int, ...] = BALANCE, virtual: int = 1) -> Plan:
    """A plan whose stage k re-computes the units ``modes[k]`` (a list) or runs the
    whole-stage mode ``modes[k]``; stages not named run ``never``."""
    made = mesh_plan(MeshCase(balance=balance, virtual=virtual, checkpoint="never"), LLAMA)
    stages = []
    for k, stage in enumerate(made.stages):
        mode = modes.get(k, "never")
        if isinstance(mode, list):
            stage = dataclasses.replace(stage, checkpoint="units", recompute_units=mode)
        else:
            stage = dataclasses.replace(stage, checkpoint=mode)
        stages.append(stage)
    return dataclasses.replace(made, stages=stages, checkpoint="auto")


def _planned_layers(plan: Plan) -> set[int]:
    """The decoder layers the plan re-computes, read from the unit names."""
    found = set()
    for stage in plan.stages:
        mode = stage.checkpoint
        chosen = stage.recompute_units if mode == "units" else []
        if mode in ("always", "except_last"):
            chosen = list(range(stage.start, stage.stop))
        found |= {int(LLAMA[u].split(".")[1]) for u in chosen if LLAMA[u].startswith("layers.")}
    return found


def _rounded(text: str) -> list[int]:
    """The stages a note says re-compute more than planned."""
    said = [re.match(r"stage (\d+) ", note) for note in _notes(text) if "more re-comp" in note]
    return sorted(int(m.group(1)) for m in said if m)


def _notes(text: str) -> list[str]:
    return [line.removeprefix("# note: ") for line in text.splitlines() if "# note:" in line]


def _recompute_notes(text: str) -> list[str]:
    return [note for note in _notes(text) if "sequence length" not in note]


# -- Megatron-LM ---------------------------------------------------------------------------

megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)


def _checkpointed(arguments: Any) -> set[int]:
    """The decoder layers Megatron's block method checkpoints under these flags: the first
    ``--recompute-num-layers`` of each (virtual) stage's TransformerBlock, its stages and
    their layers read with megatron-core's own layout parser."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    ranks = arguments.pipeline_model_parallel_size
    layout = PipelineParallelLayerLayout(arguments.pipeline_model_parallel_layout, ranks)
    found, offset = set(), 0
    for v in range(layout.virtual_pipeline_model_parallel_size):
        for r in range(ranks):  # stage v·K + r, in layer order
            count = layout.layout[r][v].count(LayerType.decoder)
            found |= set(range(offset, offset + min(count, arguments.recompute_num_layers)))
            offset += count
    return found


def _megatron(plan: Plan) -> tuple[str, Any]:
    """The export and its layout line, parsed and built into a TransformerConfig."""
    from tests.support.megatron_arguments import command_lines, transformer_config

    text = plan.export("megatron")
    lines = command_lines(text)
    for arguments in lines:
        transformer_config(arguments)  # megatron-core's own checks run
    return text, lines[0]


MEGATRON_CASES: dict[str, tuple[Modes, int]] = {
    # Every stage the first two of its layers: exactly the block method's N = 2.
    "equal prefixes": ({0: [1, 2], 1: [5, 6], 2: [9, 10], 3: [13, 14]}, 2),
    # Prefixes of 1 to 3 layers: N = 3, stages 0, 2 and 3 re-compute more.
    "unequal prefixes": ({0: [1], 1: [5, 6, 7], 2: [9], 3: [13, 14]}, 3),
    # Layers 1 and 3 of stage 1 round up to its first 4; stage 2 planned without.
    "not a prefix": ({0: [1], 1: [6, 8], 2: "never", 3: [13]}, 4),
    # A whole-stage always needs all of stage 0's 4 layers.
    "always and units": ({0: "always", 1: [5], 2: [9], 3: [13]}, 4),
    "except_last and units": ({0: [1], 1: "except_last"}, 4),
}


@megatron
@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_megatron_checkpoints_the_first_layers_covering_the_planned_ones(name: str) -> None:
    modes, first = MEGATRON_CASES[name]
    plan = _plan(modes)
    text, arguments = _megatron(plan)
    assert (arguments.recompute_granularity, arguments.recompute_method) == ("full", "block")
    assert arguments.recompute_num_layers == first
    checkpointed, planned = _checkpointed(arguments), _planned_layers(plan)
    assert checkpointed >= planned
    # Each stage re-computing more than planned says so, and only those (stage k holds
    # layers 4k to 4k + 3).
    more = sorted({layer // 4 for layer in checkpointed - planned})
    assert _rounded(text) == more


@megatron
def test_megatron_rounds_a_set_that_is_no_prefix_and_says_what() -> None:
    text, _ = _megatron(_plan(MEGATRON_CASES["not a prefix"][0]))
    assert (
        "stage 1 re-computes units 6, 8 (its decoder layers 1, 3 of 4): exported as all its 4 "
        "(--recompute-method block --recompute-num-layers 4 re-computes the first 4 of every "
        "stage), more re-computation than planned" in _notes(text)
    )
    assert (
        "stage 2 was planned without recompute; --recompute-method block --recompute-num-layers "
        "4 re-computes the first 4 of every stage: it re-computes all its 4 decoder layers, "
        "more re-computation than planned" in _notes(text)
    )
    assert "stage 0 re-computes unit 1 (its decoder layer 0 of 4): exported as all its 4" in text


@megatron
def test_equal_prefixes_are_exported_as_planned() -> None:
    text, _ = _megatron(_plan(MEGATRON_CASES["equal prefixes"][0]))
    assert _recompute_notes(text) == []
    assert "--recompute-granularity full --recompute-method block --recompute-num-layers 2" in text


@megatron
def test_units_outside_the_decoder_layers_are_kept_and_it_is_said() -> None:
    text, arguments = _megatron(_plan({0: [0], 3: [17, 18]}))  # embedding, norm and output
    assert arguments.recompute_granularity is None and "--recompute" not in text
    notes = _recompute_notes(text)
    assert len(notes) == 2
    assert notes[1] == (
        "stage 3 re-computes units 'norm', 'output', which run modules outside the layers of "
        "'layers': Megatron checkpoints only those layers, so it keeps these units' "
        "activations, more memory than planned"
    )
    # An always stage holding the embedding re-computes its layers, not the embedding.
    text, _ = _megatron(_plan(MEGATRON_CASES["always and units"][0]))
    assert "stage 0 re-computes units 'tok_embeddings', which run modules outside" in text


@megatron
def test_virtual_stages_count_their_own_layers() -> None:
    # 8 stages on 4 ranks: stage 3 (rank 3's first) holds layers 6 and 7, units 7 and 8.
    plan = _plan({3: [8], 5: [11]}, balance=(3, 2, 2, 2, 2, 2, 2, 4), virtual=2)
    text, arguments = _megatron(plan)
    assert arguments.num_virtual_stages_per_pipeline_rank is None  # the layout line
    assert arguments.recompute_num_layers == 2
    assert _checkpointed(arguments) >= _planned_layers(plan) == {7, 10}
    assert "stage 3 re-computes unit 8 (its decoder layer 1 of 2): exported as all its 2" in text


@megatron
def test_plans_without_units_keep_uniform_full_recompute() -> None:
    text, arguments = _megatron(_plan({0: "always", 1: "always", 2: "always", 3: "always"}))
    assert (arguments.recompute_method, arguments.recompute_num_layers) == ("uniform", 1)
    assert _recompute_notes(text) == []


# -- torchtitan 0.3.0 ----------------------------------------------------------------------

titan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 tyro)",
)


def _titan(plan: Plan) -> tuple[str, Any]:
    """The TOML and torchtitan's config of its stated overrides, through its ConfigManager."""
    from torchtitan.config import ConfigManager

    text = plan.export("torchtitan")
    stated = re.search(r"^# (--parallelism\..*)$", text, re.M)
    assert stated is not None, text
    registry = ["--module", "tests.support.titan_registry", "--config", "plan_config"]
    config = ConfigManager().parse_args([*registry, *shlex.split(stated.group(1))])
    data = json.loads(plan.export("torchtitan-json"))
    assert data["activation_checkpoint"] == read_toml(text)["activation_checkpoint"]
    assert data["notes"] == _notes(text)
    return text, config


@titan
def test_torchtitan_re_computes_every_block_where_the_plan_re_computes_some() -> None:
    text, config = _titan(_plan(MEGATRON_CASES["not a prefix"][0]))
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert read_toml(text)["activation_checkpoint"] == {"mode": "full"}
    assert _recompute_notes(text) == [
        "the plan re-computes layers 0, 5, 7, 12 (or units of them) of the 16 in 'layers', "
        "stages [0, 1, 2, 3] not all of theirs; torchtitan applies one activation-"
        "checkpointing policy to every layer, with no per-layer choice: it re-computes all "
        "16, more re-computation than planned"
    ]


@titan
def test_torchtitan_says_nothing_when_the_plan_re_computes_every_block() -> None:
    every: Modes = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 10, 11, 12], 3: [13, 14, 15, 16]}
    text, config = _titan(_plan(every))
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert _recompute_notes(text) == []


@titan
def test_torchtitan_keeps_units_outside_its_blocks_and_says_so() -> None:
    text, config = _titan(_plan({0: [0], 3: [18]}))
    assert config.activation_checkpoint is None  # "none": no block is planned
    assert _recompute_notes(text) == [
        "stage 0 re-computes units 'tok_embeddings', which run modules outside the layers of "
        "'layers': torchtitan checkpoints only those layers, so it keeps these units' "
        "activations, more memory than planned",
        "stage 3 re-computes units 'output', which run modules outside the layers of "
        "'layers': torchtitan checkpoints only those layers, so it keeps these units' "
        "activations, more memory than planned",
    ]


# -- plans the planner makes ---------------------------------------------------------------


def _planned(memory: int, stages: int, virtual: int = 1) -> Plan:
    """An ``auto`` plan of a small Llama whose layers' saved tensors dwarf the rest, under
    ``memory`` bytes per device: it re-computes some decoder layers."""
    names = ["tok_embeddings", *(f"layers.{i}" for i in range(8)), "norm", "output"]
    forward = [0.5, 1.0, 1.5, 1.2, 2.0, 1.1, 1.3, 1.7, 1.0, 0.2, 0.5]
    saved = [5, *[100] * 8, 5, 5]
    profile = linear_profile(
        forward, saved=saved, output=[10] * 11, batch=8, chunks=4, input_bytes=10
    )
    layers = [dataclasses.replace(layer, name=n) for layer, n in zip(profile.layers, names)]
    profile = dataclasses.replace(profile, layers=layers)
    return make_plan(
        profile, stages, chunks=4, checkpoint="auto", memory=memory, virtual_stages=virtual
    )


@pytest.mark.parametrize(
    ("memory", "stages", "virtual"), [(1200, 2, 1), (1500, 2, 1), (1150, 4, 2)]
)
def test_planned_units_export_the_first_layers_that_cover_them(
    memory: int, stages: int, virtual: int
) -> None:
    plan = _planned(memory, stages, virtual)
    assert "units" in plan.stage_checkpoints
    owns, chosens = [], []
    for stage in plan.stages:
        owns.append([name for name in stage.layers if name.startswith("layers.")])
        whole = stage.checkpoint in ("always", "except_last")
        units = range(stage.start, stage.stop) if whole else stage.recompute_units
        chosens.append([stage.layers[u - stage.start] for u in units])
    # N: the last re-computed decoder layer of each stage, counted from its first one.
    first = max(
        max((own.index(name) + 1 for name in chosen if name in own), default=0)
        for own, chosen in zip(owns, chosens, strict=True)
    )
    assert first > 0
    text = plan.export("megatron")
    assert (
        f"--recompute-granularity full --recompute-method block --recompute-num-layers {first}"
        in text
    )
    # A stage whose planned layers are not its first N says what it re-computes more.
    more = [
        k
        for k, (own, chosen) in enumerate(zip(owns, chosens, strict=True))
        if set(own[:first]) - set(chosen)
    ]
    assert _rounded(text) == more
    assert read_toml(plan.export("torchtitan"))["activation_checkpoint"] == {"mode": "full"}
