"""The torchtitan export as torchtitan 0.3.0 reads it: its ConfigManager and ParallelDims.

torchtitan 0.3.0 builds its config from a registry function and ``--section.key value``
overrides; each ``[section] key = value`` of the exported TOML (the policy's ``mode`` as
``activation-checkpoint:MODE``) becomes one, read here independently of the export, and
the loaded config must hold the plan's degrees, batches and recompute.
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
from autopipe.planning.model.mesh import Mesh
from tests.support.mesh_plans import MeshCase, mesh_plan
from tests.support.tomlfile import read_toml

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install --no-deps torchtitan==0.3.0 tyro)",
)


def _overrides(config: dict[str, Any]) -> list[str]:
    """The TOML's values as torchtitan 0.3.0's command-line overrides."""
    words = []
    for section, keys in config.items():
        if section == "activation_checkpoint":
            continue
        for key, value in keys.items():
            if isinstance(value, bool):
                words.append(f"--{section}.{key}" if value else f"--{section}.no-{key}")
            elif isinstance(value, list):
                words += [f"--{section}.{key}", *(",".join(names) for names in value)]
            else:
                words += [f"--{section}.{key}", str(value)]
    return [*words, f"activation-checkpoint:{config['activation_checkpoint']['mode']}"]


def _load(words: list[str]) -> Any:
    """torchtitan's config of the overrides, through its own ConfigManager."""
    from torchtitan.config import ConfigManager

    registry = ["--module", "tests.support.titan_registry", "--config", "plan_config"]
    return ConfigManager().parse_args([*registry, *words])


def _loaded(plan: Plan) -> tuple[Any, dict[str, Any]]:
    """torchtitan's config of the exported TOML, checked equal to the comment's overrides."""
    text = plan.export("torchtitan")
    config = _load(_overrides(read_toml(text)))
    stated = re.search(r"^# (--parallelism\..*)$", text, re.M)
    assert stated is not None, text
    assert _load(shlex.split(stated.group(1))) == config
    return config, json.loads(plan.export("torchtitan-json"))


def _dims(config: Any, world: int) -> Any:
    """torchtitan's ParallelDims of the loaded degrees on ``world`` devices (it checks that
    they multiply to the world size; expert parallelism takes none of its own)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    p = config.parallelism
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        world_size=world,
    )


CASES = {
    "fsdp": MeshCase(mesh=Mesh(tensor=2, sequence_parallel=True, zero=3), replicas=2),
    "ddp, context": MeshCase(mesh=Mesh(context=2), replicas=4, checkpoint="never"),
    "zero-1, virtual": MeshCase(
        balance=(2, 1, 1, 1, 1, 1, 1, 1), virtual=2, mesh=Mesh(tensor=4, zero=1), replicas=2
    ),
    "zero-2, except_last": MeshCase(
        mesh=Mesh(tensor=2, context=2, zero=2), replicas=2, checkpoint="except_last"
    ),
    "zero-3 over context": MeshCase(mesh=Mesh(context=2, zero=3)),
    "one stage": MeshCase(balance=(9,), mesh=Mesh(tensor=8), replicas=2, chunks=3),
    "pipeline alone": MeshCase(
        chunks=8, micro=1, checkpoint=("always", "always", "never", "never")
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_torchtitan_loads_the_plans_degrees(name: str) -> None:
    case = CASES[name]
    plan = mesh_plan(case)
    config, data = _loaded(plan)
    p, mesh, replicas = config.parallelism, case.mesh, case.replicas
    sharded = mesh.zero >= 1 and replicas > 1
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (
        (1, replicas) if sharded else (replicas, 1)
    )
    assert p.tensor_parallel_degree == mesh.tensor
    assert p.enable_sequence_parallel == mesh.sequence_parallel
    assert p.context_parallel_degree == mesh.context
    assert p.pipeline_parallel_degree == len(case.balance) // case.virtual
    assert p.module_fqns_per_model_part == [stage.layers for stage in plan.stages]
    assert p.pipeline_parallel_microbatch_size == case.micro
    # One step of one data-parallel rank: the pipeline's micro-batches, or one of them
    # accumulated chunks times without a pipeline.
    local = case.micro * (case.chunks if p.pipeline_parallel_degree > 1 else 1)
    assert config.training.local_batch_size == local
    assert config.training.global_batch_size == plan.batch_size
    recompute = any(mode != "never" for mode in plan.stage_checkpoints)
    assert type(config.activation_checkpoint).__qualname__ == (
        "FullAC.Config" if recompute else "NoneType"
    )
    assert data["world_size"] == plan.num_devices
    dims = _dims(config, data["world_size"])
    assert dims.fsdp_enabled == (sharded or mesh.context > 1)
    if dims.fsdp_enabled:  # ZeRO-3 gathers per unit as it runs; 1 and 2 keep them gathered
        assert p.fsdp_reshard_after_forward == ("always" if mesh.zero == 3 else "never")


def test_the_json_holds_the_tomls_sections() -> None:
    plan = mesh_plan(CASES["zero-2, except_last"])
    config = read_toml(plan.export("torchtitan"))
    data = json.loads(plan.export("torchtitan-json"))
    assert {key: data[key] for key in config["parallelism"]} == config["parallelism"]
    assert data["activation_checkpoint"] == config["activation_checkpoint"] == {"mode": "full"}
    assert data["training"] == config["training"]
    assert data["world_size"] == 32 == plan.num_devices


def test_the_world_size_and_what_torchtitan_runs_differently_are_stated() -> None:
    text = mesh_plan(CASES["zero-2, except_last"]).export("torchtitan")
    assert "# torchtitan, world size 32 = tensor 2 x context 2 x pipeline 4 x data 2" in text
    assert "ZeRO-2 has no torchtitan form; the nearest it runs: FSDP keeping" in text
    assert "checkpoint except_last (every micro-batch but the last recomputes)" in text
    assert "the sequence length is not in the plan" in text
    text = mesh_plan(CASES["ddp, context"]).export("torchtitan")
    assert "torchtitan shards the parameters over the context group" in text
    text = mesh_plan(CASES["zero-3 over context"]).export("torchtitan")
    assert "# note: the sequence length" in text and text.count("# note:") == 1  # as planned
    notes = json.loads(mesh_plan(CASES["pipeline alone"]).export("torchtitan-json"))["notes"]
    assert any("stages [2, 3] were planned without recompute" in note for note in notes)


def test_an_unknown_batch_writes_no_batch_sizes() -> None:
    plan = mesh_plan(MeshCase(micro=0))
    config, data = _loaded(plan)
    assert "training" not in data and "pipeline_parallel_microbatch_size" not in data
    assert config.training.local_batch_size == 8  # torchtitan's default stays
    assert any("batch size is unknown" in note for note in data["notes"])


def test_the_plans_sequence_length_is_the_training_seq_len() -> None:
    plan = dataclasses.replace(mesh_plan(MeshCase()), sequence=2048)
    config, data = _loaded(plan)
    assert data["training"]["seq_len"] == 2048
    assert config.training.seq_len == 2048
    from tests.support.titan_registry import plan_config

    unknown, _ = _loaded(mesh_plan(MeshCase()))
    assert unknown.training.seq_len == plan_config().training.seq_len


@pytest.mark.parametrize(
    ("mesh", "replicas", "borrowed"),
    [
        # ZeRO-1: torchtitan's FSDP over the replicas, EP borrowed from them and context.
        (Mesh(context=2, zero=1, expert=8), 4, True),
        (Mesh(tensor=2, sequence_parallel=True, zero=3, expert=4), 2, True),
        # Replicated (DDP) replicas lend torchtitan no expert ranks: the export says so.
        (Mesh(expert=2), 2, False),
    ],
)
def test_torchtitan_loads_the_plans_expert_parallel_degree(
    mesh: Mesh, replicas: int, borrowed: bool
) -> None:
    from tests.support.mesh_plans import with_experts

    plan = with_experts(mesh_plan(MeshCase(mesh=mesh, replicas=replicas)))
    config, data = _loaded(plan)
    p = config.parallelism
    assert p.expert_parallel_degree == data["expert_parallel_degree"] == mesh.expert
    # torchtitan's constraint: EP borrows from dp_shard x cp x tp.
    lent = p.data_parallel_shard_degree * p.context_parallel_degree * p.tensor_parallel_degree
    assert (lent % mesh.expert == 0) == borrowed
    assert any("torchtitan borrows expert parallelism" in n for n in data["notes"]) != borrowed
    dims = _dims(config, data["world_size"])
    assert dims.ep == mesh.expert and data["world_size"] == plan.num_devices


def test_a_dense_plan_writes_no_expert_degree() -> None:
    config, data = _loaded(mesh_plan(MeshCase(mesh=Mesh(zero=1), replicas=2)))
    assert "expert_parallel_degree" not in data and config.parallelism.expert_parallel_degree == 1


def test_a_plan_recomputing_the_norms_alone_is_refused() -> None:
    plan = dataclasses.replace(
        mesh_plan(MeshCase(balance=(2, 2, 2), checkpoint="never")), recompute_norms=True
    )
    for fmt in ("torchtitan", "torchtitan-json"):
        with pytest.raises(ValueError, match="re-computes the norms alone, which torchtitan"):
            plan.export(fmt)


def test_a_plan_recomputing_the_up_projections_alone_is_refused() -> None:
    plan = dataclasses.replace(
        mesh_plan(MeshCase(balance=(2, 2, 2), checkpoint="never")), recompute_up_proj=True
    )
    with pytest.raises(ValueError, match="up-projections alone, which torchtitan's .* megatron"):
        plan.export("torchtitan")
