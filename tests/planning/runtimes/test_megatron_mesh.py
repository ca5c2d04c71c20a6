"""The megatron export's mesh, batch and recompute flags, parsed back with Megatron-LM's
flags into megatron-core's own TransformerConfig and DistributedDataParallelConfig."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import re

import pytest

from autopipe.planning.model.mesh import Mesh
from tests.support.megatron_arguments import (
    command_lines,
    data_parallel_config,
    transformer_config,
)
from tests.support.mesh_plans import MeshCase, mesh_plan

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install megatron-core==0.16.1)",
)

GPT2 = ["wte", "wpe", *(f"h.{i}" for i in range(12)), "ln_f", "lm_head"]
STRATEGIES = {2: "optim_grads", 3: "optim_grads_params"}


def _random_case(rng: random.Random) -> MeshCase:
    tensor = rng.choice([1, 2, 4, 8])
    zero = rng.choice([0, 1, 2, 3])
    mesh = Mesh(
        tensor=tensor,
        context=rng.choice([1, 2, 4]),
        sequence_parallel=tensor > 1 and rng.random() < 0.5,
        zero=zero,
    )
    modes = ("always", "except_last", "never")
    return MeshCase(
        balance=(4, 3, 3, 2, 2, 2) if rng.random() < 0.5 else (5, 4, 4, 3),
        virtual=rng.choice([1, 2]),
        mesh=mesh,
        replicas=rng.choice([1, 2, 4, 16]),
        chunks=rng.randint(1, 8),
        micro=rng.randint(1, 4),
        checkpoint=rng.choice(modes),
    )


def test_every_command_line_parses_back_to_the_plans_mesh() -> None:
    rng = random.Random(0)
    seen: set[tuple[str, object]] = set()
    for _ in range(40):
        case = _random_case(rng)
        seen |= {("zero", case.mesh.zero), ("sequence", case.mesh.sequence_parallel)}
        plan = mesh_plan(case, GPT2)
        text = plan.export("megatron")
        world = re.search(r"^# Megatron-LM, world size (\d+) = ", text, re.M)
        assert world is not None, text
        assert int(world.group(1)) == plan.num_devices
        mesh, zero = case.mesh, case.mesh.zero
        for arguments in command_lines(text):
            config = transformer_config(arguments)  # megatron-core's own checks run
            assert config.tensor_model_parallel_size == mesh.tensor
            assert config.sequence_parallel == mesh.sequence_parallel
            assert config.context_parallel_size == mesh.context
            assert config.pipeline_model_parallel_size == len(case.balance) // case.virtual
            # Megatron's data-parallel size: the world over the model-parallel groups.
            model = mesh.tensor * mesh.context * config.pipeline_model_parallel_size
            assert int(world.group(1)) % model == 0
            replicas = int(world.group(1)) // model
            assert replicas == case.replicas
            # Its micro-batches per step: global / (micro · data-parallel size).
            assert arguments.micro_batch_size == case.micro
            assert arguments.global_batch_size % (case.micro * replicas) == 0
            assert arguments.global_batch_size // (case.micro * replicas) == case.chunks
            ddp = data_parallel_config(arguments)
            assert ddp.use_distributed_optimizer == (zero >= 1 or plan.shard_optimizer)
            assert ddp.use_megatron_fsdp == (zero >= 2)
            assert ddp.data_parallel_sharding_strategy == STRATEGIES.get(zero, "no_shard")
            assert (arguments.ckpt_format == "fsdp_dtensor") == (zero >= 2)
            full = case.checkpoint != "never"
            assert config.recompute_granularity == ("full" if full else None)
            assert config.recompute_method == ("uniform" if full else None)
            assert config.recompute_num_layers == (1 if full else None)
    assert len(seen) == 6, seen  # every ZeRO stage, with and without sequence parallelism


def test_a_plan_without_a_mesh_writes_the_degrees_of_one() -> None:
    plan = mesh_plan(MeshCase(balance=(5, 4, 4, 3), checkpoint="never"), GPT2)
    (layout, counted) = command_lines(plan.export("megatron"))
    for arguments in (layout, counted):
        assert arguments.tensor_model_parallel_size == arguments.context_parallel_size == 1
        assert not arguments.sequence_parallel and not arguments.use_distributed_optimizer
        assert arguments.recompute_granularity is None
        assert (arguments.micro_batch_size, arguments.global_batch_size) == (2, 8)


def test_except_last_maps_to_full_recompute_and_says_so() -> None:
    plan = mesh_plan(MeshCase(balance=(5, 4, 4, 3), checkpoint="except_last"), GPT2)
    text = plan.export("megatron")
    assert (
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" in text
    )
    assert (
        "# note: checkpoint except_last (every micro-batch but the last recomputes) has no "
        "Megatron form: the export recomputes every micro-batch, the last one too" in text
    )


def test_stages_without_recompute_recompute_there_and_the_export_says_so() -> None:
    modes = ("always", "never", "never", "always")
    text = mesh_plan(MeshCase(balance=(5, 4, 4, 3), checkpoint=modes), GPT2).export("megatron")
    assert "stages [1, 2] were planned without recompute; Megatron applies one mode" in text
    assert all(a.recompute_granularity == "full" for a in command_lines(text))


def test_an_unknown_batch_writes_no_batch_sizes() -> None:
    text = mesh_plan(MeshCase(balance=(5, 4, 4, 3), micro=0), GPT2).export("megatron")
    assert "# note: the plan's batch size is unknown: no batch sizes are written" in text
    assert all(a.micro_batch_size is None for a in command_lines(text))


def test_the_plans_sequence_length_is_the_seq_length() -> None:
    case = MeshCase(balance=(4, 3, 3, 2, 2, 2), mesh=Mesh(tensor=2), replicas=2, micro=1)
    plan = dataclasses.replace(mesh_plan(case, GPT2), sequence=8192)
    assert all(a.seq_length == 8192 for a in command_lines(plan.export("megatron")))
    assert all(
        a.seq_length is None for a in command_lines(mesh_plan(case, GPT2).export("megatron"))
    )


@pytest.mark.parametrize(
    ("mesh", "replicas"),
    [
        (Mesh(tensor=2, sequence_parallel=True, zero=1, expert=4), 4),
        (Mesh(context=2, expert=8), 4),  # EP over the data x context ranks
        (Mesh(expert=2), 2),
    ],
)
def test_routed_experts_parse_back_to_the_plans_expert_parallelism(
    mesh: Mesh, replicas: int
) -> None:
    from tests.support.megatron_arguments import moe_command_lines, moe_transformer_config
    from tests.support.mesh_plans import with_experts

    case = MeshCase(balance=(5, 4, 4, 3), mesh=mesh, replicas=replicas, checkpoint="never")
    plan = with_experts(mesh_plan(case, GPT2), experts=8, top_k=2)
    text = plan.export("megatron")
    assert f"(expert {mesh.expert} within data x context)" in text
    for arguments in moe_command_lines(text):
        config = moe_transformer_config(arguments)  # megatron-core's own checks run
        assert config.num_moe_experts == 8 and config.moe_router_topk == 2
        assert config.expert_model_parallel_size == mesh.expert
        # Megatron forms the expert groups inside data x context (x tensor, the experts'
        # own tensor parallelism being 1): e divides them.
        assert (replicas * mesh.context) % config.expert_model_parallel_size == 0
        # The experts whole on every device of a tensor-parallel group (Megatron's
        # default would divide them as the dense layers).
        assert config.expert_tensor_parallel_size == 1


def test_a_dense_plan_writes_no_expert_flags() -> None:
    text = mesh_plan(MeshCase(balance=(5, 4, 4, 3), replicas=2), GPT2).export("megatron")
    assert "expert" not in text and "--num-experts" not in text


def test_routed_experts_under_tensor_parallelism_get_sequence_parallelism() -> None:
    from tests.support.megatron_arguments import moe_command_lines, moe_transformer_config
    from tests.support.mesh_plans import with_experts

    case = MeshCase(balance=(5, 4, 4, 3), mesh=Mesh(tensor=2, expert=2), replicas=2)
    text = with_experts(mesh_plan(case, GPT2)).export("megatron")
    assert "only under sequence parallelism: --sequence-parallel is written" in text
    assert all(moe_transformer_config(a).sequence_parallel for a in moe_command_lines(text))


def test_recomputed_norms_are_megatrons_selective_layernorm_recompute() -> None:
    case = MeshCase(balance=(5, 4, 4, 3), mesh=Mesh(tensor=2), checkpoint="never")
    plan = dataclasses.replace(mesh_plan(case, GPT2), recompute_norms=True)
    text = plan.export("megatron")
    for arguments in command_lines(text):
        config = transformer_config(arguments)  # megatron-core's own checks run
        assert config.recompute_granularity == "selective"
        assert config.recompute_modules == ["layernorm"]
        assert config.recompute_method is None


def test_recomputed_norms_with_whole_layers_recomputed_are_refused() -> None:
    case = MeshCase(balance=(5, 4, 4, 3), checkpoint="always")
    plan = dataclasses.replace(mesh_plan(case, GPT2), recompute_norms=True)
    with pytest.raises(ValueError, match="--recompute-granularity takes one of them"):
        plan.export("megatron")


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_a_schedule_megatron_does_not_run_is_named_with_what_runs_instead(schedule: str) -> None:
    plan = mesh_plan(MeshCase(balance=(5, 4, 4, 3), checkpoint="never", schedule=schedule), GPT2)
    text = plan.export("megatron")
    assert f"# note: Megatron-LM runs its 1F1B schedule, not the plan's {schedule}" in text
    assert "1F1B schedule" not in mesh_plan(MeshCase(balance=(5, 4, 4, 3)), GPT2).export("megatron")


def test_recomputed_up_projections_join_the_selective_modules() -> None:
    case = MeshCase(balance=(5, 4, 4, 3), mesh=Mesh(tensor=2), checkpoint="never")
    plan = dataclasses.replace(mesh_plan(case, GPT2), recompute_norms=True, recompute_up_proj=True)
    text = plan.export("megatron")
    assert "--recompute-granularity selective --recompute-modules layernorm mla_up_proj" in text
    for arguments in command_lines(text):
        # megatron-core's own checks run, with the latent attention the model declares.
        config = transformer_config(arguments, multi_latent_attention=True)
        assert config.recompute_granularity == "selective"
        assert config.recompute_modules == ["layernorm", "mla_up_proj"]


def test_recomputed_up_projections_with_whole_layers_recomputed_are_refused() -> None:
    case = MeshCase(balance=(5, 4, 4, 3), checkpoint="always")
    plan = dataclasses.replace(mesh_plan(case, GPT2), recompute_up_proj=True)
    with pytest.raises(ValueError, match="mla_up_proj modules, and Megatron-LM"):
        plan.export("megatron")
