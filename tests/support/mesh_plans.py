"""Plans of named layers with a mesh, replicas, batches and checkpoint modes set, for the
tests of the torchtitan and Megatron exports (no torch)."""

from __future__ import annotations

import copy
import dataclasses

from autopipe import Plan
from autopipe.planning.model.mesh import Mesh
from tests.support.export_cases import named_plan

LLAMA = ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm", "output"]


@dataclasses.dataclass(frozen=True)
class MeshCase:
    """What a test plan runs on: ``balance`` over ranks times ``virtual``, the mesh
    around it, ``replicas`` of it, ``chunks`` micro-batches of ``micro`` samples per
    replica, one checkpoint mode per stage (or one for all), under ``schedule``."""

    balance: tuple[int, ...] = (3, 2, 2, 2)
    virtual: int = 1
    mesh: Mesh = dataclasses.field(default_factory=Mesh)
    replicas: int = 1
    chunks: int = 4
    micro: int = 2
    checkpoint: str | tuple[str, ...] = "always"
    schedule: str = "1f1b"


def mesh_plan(case: MeshCase, names: list[str] | None = None) -> Plan:
    """A plan of layers named ``names`` (a torchtitan Llama of 6 layers) as ``case`` says.

    ``micro = 0`` makes a plan whose batch size is unknown.
    """
    made = named_plan(names or LLAMA, list(case.balance), case.virtual)
    modes = case.checkpoint
    if isinstance(modes, str):
        modes = (modes,) * len(case.balance)
    stages = [dataclasses.replace(s, checkpoint=m) for s, m in zip(made.stages, modes, strict=True)]
    return dataclasses.replace(
        made,
        stages=stages,
        checkpoint=modes[0] if len(set(modes)) == 1 else "auto",
        schedule=case.schedule,
        mesh=case.mesh,
        data_parallel=case.replicas,
        shard_optimizer=case.mesh.zero >= 1 and case.replicas > 1,
        chunks=case.chunks,
        micro_batch=case.micro,
        batch_size=case.micro * case.chunks * case.replicas,
    )


def with_experts(made: Plan, experts: int = 8, top_k: int = 2) -> Plan:
    """``made`` whose profile record gives every transformer layer (``layers.*``,
    ``h.*``) one mixture-of-experts block of ``experts`` routed experts, ``top_k`` per
    token."""
    profile = copy.deepcopy(made.profile)
    width = len(profile["batch_sizes"])
    for layer in profile["layers"]:
        if layer["name"].startswith(("layers.", "h.")):
            layer["experts"] = {
                "experts": experts, "top_k": top_k, "blocks": 1, "param_bytes": 0,
                **{name: [0] * width for name in (
                    "flops", "backward_flops", "backward_input_flops", "saved",
                    "dispatch_bytes",
                )},
            }  # fmt: skip
    return dataclasses.replace(made, profile=profile)
