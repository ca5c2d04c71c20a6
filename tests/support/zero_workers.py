"""Ranks of the sharded-replica scenarios: ZeRO-2/3 pipelines trained as the plain model."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from tests.support.dist_models import sgd_steps
from tests.support.tp_workers import batch as token_batch
from tests.support.tp_workers import tiny_llama, token_loss

CHUNKS = 2
STEPS = 3
LR = 0.1
REPLICAS = 2


def mlp() -> nn.Module:
    """A float64 MLP of 5 layers, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    ).double()


def mlp_batch() -> tuple[Tensor, Tensor]:
    """The global mini-batch (8 rows) and its targets."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 8, dtype=torch.float64, generator=generator)
    return x, torch.randn(8, 4, dtype=torch.float64, generator=generator)


def mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


# name: (model, batch, loss, units)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any, int]] = {
    "mlp": (mlp, mlp_batch, mse, 5),
    "llama": (tiny_llama, token_batch, token_loss, 6),  # embedding, rotary, 2 layers, norm, head
}


def reference(name: str) -> dict[str, Any]:
    """The plain model trained on the global batch: each of the D·M micro-batches' losses
    averaged, as the replicas' pipelines split it."""
    make, data, loss_fn, _ = MODELS[name]
    model, (x, y) = make(), data()
    steps = sgd_steps(model, x, y, loss_fn, REPLICAS * CHUNKS, STEPS, LR)
    return {"losses": [s["loss"] for s in steps], "state": copy.deepcopy(model.state_dict())}


def zero_run(name: str, stages: int, zero: int, from_plan: bool) -> dict[str, Any]:
    """STEPS SGD steps of a pipeline of ``stages`` stages times 2 replicas at ZeRO ``zero``
    (passed as ``zero=``, or as a given plan's ``mesh.zero``)."""
    from torch.distributed.tensor import DTensor

    from autopipe.distributed import DistributedPipeline
    from autopipe.planning import Mesh
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    make, data, loss_fn, units = MODELS[name]
    model, (x, y) = make(), data()
    whole = {n: p.numel() for n, p in model.named_parameters()}
    balance = [units - (stages - 1) * (units // stages)] + [units // stages] * (stages - 1)
    profile = linear_profile([1.0] * units, batch=len(x), chunks=CHUNKS)
    plan = evaluate(profile, balance, chunks=CHUNKS, schedule="1f1b", data_parallel=REPLICAS)
    keywords: dict[str, Any] = {"zero": zero}
    if from_plan:
        plan, keywords = dataclasses.replace(plan, mesh=Mesh(zero=zero)), {}
    pipe = DistributedPipeline(
        model, x, loss_fn=loss_fn, chunks=CHUNKS, plan=plan, data_parallel=REPLICAS, **keywords
    )
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        losses.append(pipe.step(x, y))
        opt.step()
        opt.zero_grad()
    params = pipe.named_parameters()
    return {
        "stage": pipe.stage_index,
        "zero": pipe.zero,
        "losses": losses,
        "sharded": all(isinstance(p, DTensor) for _, p in params),
        "local": {n: p.to_local().numel() for n, p in params if isinstance(p, DTensor)},
        "whole": {n: whole[n] for n, _ in params},
        "own state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
        "state": pipe.gather_state_dict(),
    }


# (model, stages, zero, from the plan), by world size: K = world / D.
RUNS = {
    world: [
        (name, world // REPLICAS, zero, zero == 3 and name == "mlp")
        for name in MODELS
        for zero in (2, 3)
    ]
    for world in (2, 4)
}


def sharded(world: int) -> dict[str, Any]:
    """Every run for this world size and the plain models' references."""
    return {
        "runs": [zero_run(*run) for run in RUNS[world]],
        "reference": {name: reference(name) for name in MODELS},
    }
