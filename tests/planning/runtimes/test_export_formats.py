"""Plan.export: each runtime's form of the split, read back; splits a format cannot hold refused."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from autopipe.planning.runtimes.export_formats import EXPORT_FORMATS, check_export_format
from tests.support.export_cases import named_plan
from tests.support.tomlfile import read_toml

LLAMA = ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm", "output"]
GPT2 = [
    "transformer.wte",
    "transformer.wpe",
    "transformer.drop",
    *(f"transformer.h.{i}" for i in range(10)),
    "transformer.ln_f",
    "lm_head",
]


def _stage_names(plan) -> list[list[str]]:
    return [stage.layers for stage in plan.stages]


def test_torch_split_spec_names_where_stages_begin() -> None:
    plan = named_plan(LLAMA, [3, 2, 2, 2])
    text = plan.export("torch")
    assert re.findall(r'"([^"]+)": SplitPoint.BEGINNING', text) == ["layers.2", "layers.4", "norm"]
    assert "from torch.distributed.pipelining import SplitPoint" in text
    data = json.loads(plan.export("torch-json"))
    assert data["split_spec"] == {
        "layers.2": "BEGINNING",
        "layers.4": "BEGINNING",
        "norm": "BEGINNING",
    }
    assert (data["num_stages"], data["ranks"], data["virtual_stages"]) == (4, 4, 1)


def test_a_merged_unit_begins_at_its_first_module() -> None:
    plan = named_plan(["a", "b+c", "d"], [1, 2])
    assert json.loads(plan.export("torch-json"))["split_spec"] == {"b": "BEGINNING"}
    assert json.loads(plan.export("torchtitan-json"))["module_fqns_per_model_part"] == [
        ["a"],
        ["b", "c", "d"],
    ]


@pytest.mark.parametrize(("balance", "virtual"), [([3, 2, 2, 2], 1), ([2, 1, 2, 1, 1, 2], 2)])
def test_torchtitan_parts_list_every_module_once_in_order(balance: list[int], virtual: int) -> None:
    plan = named_plan(LLAMA, balance, virtual)
    config = read_toml(plan.export("torchtitan"))["parallelism"]
    parts = config["module_fqns_per_model_part"]
    assert parts == _stage_names(plan)  # stage s is list s: rank r holds r, r + K, ...
    assert [name for part in parts for name in part] == LLAMA
    assert config["pipeline_parallel_degree"] == len(balance) // virtual
    assert config["pipeline_parallel_schedule"] == ("LoopedBFS" if virtual > 1 else "GPipe")
    assert json.loads(plan.export("torchtitan-json"))["module_fqns_per_model_part"] == parts


def test_torchtitan_keeps_the_entries_of_a_top_level_list_whole() -> None:
    # Leaf units of torchtitan's Llama are named as torchtitan's splitter keeps them.
    names = ["tok_embeddings", "layers.0.attention", "layers.0.feed_forward", "layers.1", "norm"]
    plan = named_plan(names, [3, 2])
    parts = json.loads(plan.export("torchtitan-json"))["module_fqns_per_model_part"]
    assert parts == [["tok_embeddings", "layers.0"], ["layers.1", "norm"]]


def _unroll(layout: str) -> list[str]:
    """Megatron's layout grammar, read independently: ``(..)*n`` and ``x*n`` repeat,
    commas are cosmetic, ``|`` separates the stages."""
    layout = layout.replace(",", "")
    layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    layout = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    return layout.split("|")


def _decoders(plan, stack: str) -> list[int]:
    pattern = re.compile(rf"{re.escape(stack)}\.\d+$")
    return [sum(bool(pattern.match(n)) for n in stage.layers) for stage in plan.stages]


def _megatron(text: str) -> tuple[list[str], dict[str, str] | None]:
    """The layout's stages and, when given, the first/last arguments."""
    layout = re.search(r'--pipeline-model-parallel-layout "([^"]+)"', text)
    assert layout is not None, text
    uneven = re.search(r"^(--num-layers .*--decoder-first-pipeline-num-layers.*)$", text, re.M)
    flags = dict(re.findall(r"--([a-z-]+) (\d+)", uneven.group(1))) if uneven else None
    return _unroll(layout.group(1)), flags


@pytest.mark.parametrize(
    ("balance", "virtual", "uneven"),
    [
        ([4, 3, 4, 4], 1, False),  # 10 layers on 4 stages: not divisible
        ([5, 4, 4, 2], 1, False),  # the last stage holds no decoder layer
        ([5, 3, 3, 4], 1, True),
        ([4, 2, 2, 2, 1, 1, 1, 2], 2, False),  # 8 stages on 4 ranks
        ([4, 1, 1, 2, 1, 1, 1, 4], 2, True),
        ([5, 3, 2, 5], 2, False),  # 4 stages on 2 ranks: Megatron's offsets need 3 or more
        ([5, 3, 2, 2, 1, 2], 3, False),  # 6 stages on 2 ranks, 3 each
    ],
)
def test_megatron_layout_round_trips_to_the_layer_counts(
    balance: list[int], virtual: int, uneven: bool
) -> None:
    plan = named_plan(GPT2, balance, virtual)
    stages, flags = _megatron(plan.export("megatron"))
    assert (flags is not None) == uneven
    assert len(stages) == plan.num_stages
    assert [stage.count("t") for stage in stages] == _decoders(plan, "transformer.h")
    assert stages[0].startswith("E") and stages[-1].endswith("L")
    assert set("".join(stages[1:])) <= {"t", "L"} and "L" not in "".join(stages[:-1])
    ranks = plan.num_stages // virtual
    assert f"--pipeline-model-parallel-size {ranks} " in plan.export("megatron")
    if flags is not None:  # Megatron's rule: middle ranks equal, each rank's stages equal
        counts = _decoders(plan, "transformer.h")
        first, last = (
            int(flags["decoder-first-pipeline-num-layers"]),
            int(flags["decoder-last-pipeline-num-layers"]),
        )
        middle = (sum(counts) - first - last) // max(ranks - 2, 1)
        per_rank = [first, *[middle] * (ranks - 2), last]
        rebuilt = [per_rank[s % ranks] // virtual for s in range(plan.num_stages)]
        assert rebuilt == counts
        assert int(flags.get("num-virtual-stages-per-pipeline-rank", 1)) == virtual


def test_megatron_first_and_last_counts_when_they_describe_the_split() -> None:
    text = named_plan(GPT2, [5, 3, 3, 4]).export("megatron")  # E + 2, 3, 3, 2 + L
    assert "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2" in text
    assert '"Ett|t*3|t*3|ttL"' in text
    text = named_plan(GPT2, [5, 2, 4, 4]).export("megatron")  # middle ranks 2 and 4
    assert "not expressible by --decoder-first/last-pipeline-num-layers" in text
    assert "middle ranks hold [2, 4]" in text


def test_llama_names_of_hugging_face() -> None:
    names = ["model.embed_tokens", "model.rotary_emb", *(f"model.layers.{i}" for i in range(4))]
    plan = named_plan([*names, "model.norm", "lm_head"], [3, 2, 3])
    stages, _ = _megatron(plan.export("megatron"))
    assert stages == ["Et", "tt", "tL"]


def test_deepspeed_parts_are_the_stage_boundaries() -> None:
    plan = named_plan(LLAMA, [3, 2, 2, 2])
    data = json.loads(plan.export("deepspeed"))
    assert data["parts"] == [0, 3, 5, 7, 9] and data["num_stages"] == 4
    assert data["layers"] == _stage_names(plan)


def test_slash_names_of_older_profiles_export_with_dots() -> None:
    plan = named_plan([n.replace(".", "/") for n in LLAMA], [3, 6])
    assert json.loads(plan.export("torch-json"))["split_spec"] == {"layers.2": "BEGINNING"}
    assert json.loads(plan.export("torchtitan-json"))["module_fqns_per_model_part"][0] == [
        "tok_embeddings",
        "layers.0",
        "layers.1",
    ]


def test_unknown_format_is_refused() -> None:
    assert check_export_format("torch") == "torch" and "megatron" in EXPORT_FORMATS
    plan = named_plan(LLAMA, [3, 6])
    with pytest.raises(ValueError, match=r"unknown export format 'onnx'; choose torch, torch-json"):
        plan.export("onnx")


@pytest.mark.parametrize(
    ("names", "balance", "fmt", "message"),
    [
        (["a", "forward"], [1, 1], "torch", r"unit 'forward' of stage 1 is no module call"),
        (["a", "b", "a#2"], [2, 1], "torch", r"module 'a' is called in stage 0 .* and in stage 1"),
        (
            ["a", "b#2", "b"],
            [1, 2],
            "torch",
            r"stage 1 begins with unit 'b#2', call 2 of module 'b'",
        ),
        (["a", "b", "c", "b#2"], [1, 3], "torch", r"module 'b', which is called more than once"),
        (
            ["inp", "blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "head"],
            [4, 2],
            "torchtitan",
            r"the cut between stages 0 and 1 \(units 'blocks.1.0' and 'blocks.1.1'\) lies inside "
            r"'blocks.1', which torchtitan keeps whole",
        ),
        (
            ["model.embed", "model.layers.0", "model.layers.1", "lm_head"],
            [2, 2],
            "torchtitan-json",
            r"lies inside 'model'",
        ),
        (
            ["wte", "h.0.attn", "h.0.mlp", "h.1", "lm_head"],
            [2, 3],
            "megatron",
            r"the cut between stages 0 and 1 \(units 'h.0.attn' and 'h.0.mlp'\) lies inside "
            r"decoder layer h.0, which Megatron counts as one layer",
        ),
        (["wte", "wpe", "h.0", "h.1", "head"], [1, 4], "megatron", r"unit 'wpe', before the first"),
        (["wte", "h.0", "h.1", "norm", "head"], [4, 1], "megatron", r"unit 'norm', after the last"),
        (
            ["enc.0", "enc.1", "dec.0", "dec.1"],
            [2, 2],
            "megatron",
            r"2 stacks of layers \(enc, dec\)",
        ),
        (["0", "1", "2"], [1, 2], "megatron", r"no stack of decoder layers"),
        (LLAMA, [2, 2, 2, 3], "deepspeed", r"runs one stage per rank but the plan has 2 per rank"),
    ],
)
def test_a_split_the_format_cannot_hold_is_refused(
    names: list[str], balance: list[int], fmt: str, message: str
) -> None:
    virtual = 2 if fmt == "deepspeed" else 1
    plan = named_plan(names, balance, virtual)
    with pytest.raises(ValueError, match=rf"cannot export the plan as {fmt}: .*{message}"):
        plan.export(fmt)


@pytest.mark.parametrize(
    ("schedule", "name"), [("zbv", "ZBVZeroBubble"), ("dualpipev", "DualPipeV")]
)
def test_torchtitan_v_schedules_list_the_parts_in_stage_order(schedule: str, name: str) -> None:
    plan = dataclasses.replace(named_plan(LLAMA, [2, 1, 2, 4], 2), schedule=schedule)
    text = plan.export("torchtitan")
    config = read_toml(text)["parallelism"]
    # torchtitan maps part i to stage i and stage i to its V rank (rank r: r and 2K-1-r).
    assert config["module_fqns_per_model_part"] == _stage_names(plan)
    assert config["pipeline_parallel_schedule"] == name
    assert config["pipeline_parallel_degree"] == 2
    assert "rank r runs stages r and 3-r" in text
    with pytest.raises(ValueError, match="no V schedule"):
        plan.export("megatron")
