"""Rank workers of data-parallel replicas and of virtual (interleaved) stages."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tests.support.dist_models import (
    BATCH,
    CHUNKS,
    REPLICA_CHUNKS,
    loss_fn,
    make_batch,
    make_model,
    param_grads,
    titan_position,
    train_twice,
)


def _replica_train(pipe: Any, x: Tensor, y: Tensor, rows: slice) -> dict[str, Any]:
    """Two global steps, the state, a step on this replica's shard, one on unequal grads."""
    result = train_twice(pipe, x, y)
    result["state"] = pipe.gather_state_dict()
    result["own state"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    pipe.module.zero_grad()
    result["shard loss"] = pipe.step(x[rows], y[rows])
    result["shard"] = param_grads(pipe)
    # Earlier gradients that differ between replicas stay; only the step's are averaged.
    for p in pipe.module.parameters():
        p.grad = torch.full_like(p, float(pipe.replica_index + 1))
    pipe.step(x, y)
    result["unequal"] = param_grads(pipe)
    return result


def replicas(rank: int, world: int) -> dict[str, Any]:
    """D=2 replicas of a K=world/2 stage pipeline."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from profiler.profile import Profile

    d, k = 2, world // 2
    x, y = make_batch()
    b = BATCH // d
    _, replica, _ = titan_position(rank, k, d)
    rows = slice(replica * b, (replica + 1) * b)
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": REPLICA_CHUNKS}
    pipe = DistributedPipeline(make_model(), x, schedule="gpipe", data_parallel=d, **options)
    plan = pipe.plan
    results["layout"] = (plan.data_parallel, plan.batch_size, pipe.batch_size, repr(pipe))
    results["gpipe"] = _replica_train(pipe, x, y, rows)
    # 1F1B on a given uneven split; the plan brings D, and its batch size marks the sample
    # (8 rows, a multiple of D·chunks, so global by size alone) as this replica's shard.
    profile = Profile.from_dict(plan.profile)
    balance = [8 - (k - 1)] + [1] * (k - 1)
    given = evaluate(
        profile, balance, chunks=REPLICA_CHUNKS, schedule="1f1b", data_parallel=d, batch=BATCH
    )
    pipe = DistributedPipeline(make_model(), x[rows], plan=given, **options)
    results["1f1b"] = _replica_train(pipe, x, y, rows)
    errors = {}
    try:
        pipe.step(x[:4], y[:4])
    except ValueError as exc:
        errors["step"] = str(exc)
    cases = {
        "world": {"data_parallel": 3},
        "plan": {"data_parallel": d, "plan": evaluate(profile, balance, chunks=REPLICA_CHUNKS)},
        "ranks": {"data_parallel": d if rank else 1},
    }
    for name, case in cases.items():
        try:
            DistributedPipeline(make_model(), x, **options, **case)
        except ValueError as exc:
            errors[name] = str(exc)
    results["errors"] = errors
    return results


def virtual(rank: int) -> dict[str, Any]:
    """Two virtual stages per rank (K·v stages), both schedules, and the checks of v."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from autopipe.planning.schedules.simulation import makespan, simulate
    from profiler.profile import Profile

    x, y = make_batch()
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "virtual_stages": 2}
    for schedule in ("gpipe", "1f1b", "zb"):
        pipe = DistributedPipeline(make_model(), x, chunks=CHUNKS, schedule=schedule, **options)
        result = train_twice(pipe, x, y)
        result["state"] = pipe.gather_state_dict()
        result["layout"] = (pipe.stage_indices, pipe.is_first, pipe.is_last, repr(pipe))
        result["optimized"] = sum(p.numel() for p in pipe.module.parameters())
        plan = pipe.plan
        result["plan"] = (plan.virtual_stages, plan.step_time, makespan(simulate(plan)))
        results[schedule] = result
    profile = Profile.from_dict(pipe.plan.profile)
    errors = {}
    cases = {
        "stages": {"plan": evaluate(profile, [4, 4], chunks=CHUNKS), "sample": x},
        "chunks": {"chunks": 5, "sample": x[:10]},  # 2 rounds of 2 or 3 micro-batches
        "ranks": {"virtual_stages": 2 if rank else 3, "sample": x},
        "planned": {"plan": evaluate(profile, [2] * 4, chunks=CHUNKS, virtual_stages=4)},
    }
    for name, case in cases.items():
        case = {"chunks": CHUNKS, "profile": profile, "sample": x, **options, **case}
        try:
            DistributedPipeline(make_model(), case.pop("sample"), **case)
        except ValueError as exc:
            errors[name] = str(exc)
    results["errors"] = errors
    return results
