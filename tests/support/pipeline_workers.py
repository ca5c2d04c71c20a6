"""Rank workers of the pipeline-equivalence scenarios: every schedule, split, wrapped model,
re-materialization mode, uneven micro-batches, calibration, the search and autocast."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.support.dist_models import (
    CHUNKS,
    UNEVEN,
    loss_fn,
    make_batch,
    make_model,
    make_residual,
    param_grads,
    train_twice,
)


def _wrapped(schedule: str) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    x = x[:, :5]
    pipe = DistributedPipeline(
        make_residual(), x, loss_fn=loss_fn, chunks=CHUNKS, schedule=schedule
    )
    first = pipe.step(x, y)
    grads = param_grads(pipe)
    state = pipe.gather_state_dict()
    return {"loss": first, "grads": grads, "balance": pipe.plan.balance, "state": state}


def equal(rank: int, world: int) -> dict[str, Any]:
    """One stage per rank: each schedule, a given uneven split, the setup mismatches every
    rank reports, then the wrapped, calibrated, uneven, checkpointed and searched runs."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from profiler.profile import Profile

    x, y = make_batch()
    results: dict[str, Any] = {}
    model = make_model()
    pipe = DistributedPipeline(model, x, loss_fn=loss_fn, chunks=CHUNKS, schedule="gpipe")
    results["gpipe"] = train_twice(pipe, x, y)
    results["state"] = pipe.gather_state_dict()
    # 1F1B on a given, deliberately uneven split (last stage gets one layer).
    profile = Profile.from_dict(pipe.plan.profile)
    balance = [1] * (world - 1) + [8 - (world - 1)]
    balance[0], balance[-1] = balance[-1], balance[0]
    given = evaluate(profile, balance, chunks=CHUNKS, schedule="1f1b")
    pipe = DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, plan=given)
    results["1f1b"] = train_twice(pipe, x, y)
    # Zero bubble, one stage per rank: the backward split into input and weight gradients.
    pipe = DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, schedule="zb")
    results["zb"] = train_twice(pipe, x, y)
    # Mismatches, reported on every rank before the first step.
    errors = {}
    other = make_model(width=16 if rank == 0 else 12)
    try:
        DistributedPipeline(other, x, loss_fn=loss_fn, chunks=CHUNKS, profile=profile)
    except ValueError as exc:
        errors["model"] = str(exc)
    wrong = evaluate(profile, [4, 4] if world != 2 else [3, 3, 2], chunks=CHUNKS, schedule="1f1b")
    try:
        DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, plan=wrong)
    except ValueError as exc:
        errors["stages"] = str(exc)
    try:
        DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS if rank else 3)
    except ValueError as exc:
        errors["argument"] = str(exc)
    results["errors"] = errors
    for schedule in ("gpipe", "1f1b"):
        results[f"wrapped {schedule}"] = _wrapped(schedule)
    results["calibration"] = _calibration()
    results["uneven"] = _uneven()
    results["checkpointed"] = _checkpointed()
    results["searched"] = _searched()
    return results


def _searched() -> dict[str, Any]:
    """The configuration the search ranks first, built on every rank."""
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    pipe = DistributedPipeline.from_search(make_model(), x, loss_fn=loss_fn)
    result = train_twice(pipe, x, y)
    plan = pipe.plan
    result["config"] = (plan.num_devices, plan.data_parallel, plan.chunks, plan.virtual_stages)
    result["notes"] = plan.notes
    try:
        DistributedPipeline.from_search(
            make_model(), x, loss_fn=loss_fn, search_options={"memory": 100}
        )
    except ValueError as exc:
        result["error"] = str(exc)
    return result


def _checkpointed() -> dict[str, Any]:
    """Re-materialization in the stages (with BatchNorm): each mode and schedule."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.distributed.stage import StageModule

    x, y = make_batch()
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    runs = [("always", "1f1b", 1), ("except_last", "gpipe", 1), ("auto", "1f1b", 1)]
    runs.append(("except_last", "gpipe", 2))  # looped BFS: backwards in reverse
    for mode, schedule, v in runs:
        pipe = DistributedPipeline(
            make_model(), x, schedule=schedule, checkpoint=mode, virtual_stages=v, **options
        )
        result = train_twice(pipe, x, y)
        result["state"] = pipe.gather_state_dict()
        stages = [m for m in pipe.module.modules() if isinstance(m, StageModule)]
        result["checkpointed"] = [(m.checkpoint, m.checkpointed) for m in stages]
        result["spared"] = [m.spared for m in stages]
        result["plan"] = pipe.plan.checkpoint
        results[f"{mode} {schedule}" + (f" x{v}" if v > 1 else "")] = result
    try:
        DistributedPipeline(make_model(), x, checkpoint="sometimes", **options)
    except ValueError as exc:
        results["error"] = str(exc)
    return results


def _uneven() -> dict[str, Any]:
    """Micro-batches of unequal size (padded for torch's stages), and BatchNorm refused."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from profiler.profile import Profile

    x, y = make_batch()
    x, y = x[:UNEVEN], y[:UNEVEN]
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    pipe = DistributedPipeline(make_model(batchnorm=False), x, schedule="1f1b", **options)
    results: dict[str, Any] = {"sequential": train_twice(pipe, x, y)}
    # The plan times every micro-batch at the padded size, as they run.
    profile = Profile.from_dict(pipe.plan.profile)
    same = {"chunks": CHUNKS, "schedule": "1f1b", "checkpoint": pipe.plan.checkpoint}
    results["plan"] = [
        [stage.compute for stage in plan.stages]
        for plan in (
            pipe.plan,
            evaluate(profile, pipe.plan.balance, padded=True, **same),
            evaluate(profile, pipe.plan.balance, batch=4 * CHUNKS, **same),  # 4 rows each
        )
    ]
    pipe = DistributedPipeline(make_residual(), x[:, :5], schedule="gpipe", **options)
    results["wrapped"] = {"loss": pipe.step(x[:, :5], y), "grads": param_grads(pipe)}
    try:
        DistributedPipeline(make_model(), x, **options)
    except ValueError as exc:
        results["batchnorm"] = str(exc)
    return results


def _calibration() -> dict[str, Any]:
    from autopipe.distributed.calibration import calibrate_ranks
    from autopipe.planning.planner import plan
    from profiler.measure import profile_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(8, 8)
    profile = profile_model(model, x, chunks=2, warmup=0, repeats=1, cold_cache=False)
    values = calibrate_ranks(profile, repeats=3, model=model, sample=x, virtual_stages=2)
    replicated = plan(profile, 1, data_parallel=2, checkpoint="never")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"values": values, "allreduce": replicated.allreduce, "params": params}


def autocast() -> dict[str, Any]:
    """Profiled and trained under bfloat16 autocast; a step under an autocast the pipeline
    was not built for is refused (its stages would exchange float32-sized buffers)."""
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    for schedule in ("gpipe", "1f1b"):
        pipe = DistributedPipeline(
            make_model(), x, schedule=schedule, autocast="bfloat16", **options
        )
        loss = pipe.step(x, y)
        results[schedule] = {"loss": loss, "grads": param_grads(pipe), "plan": pipe.plan.profile}
    plain = DistributedPipeline(make_model(), x, **options)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain.step(x, y)
    except ValueError as exc:
        results["refused"] = str(exc)
    return results


class Constants(nn.Module):
    """Tensors that are neither parameters nor state_dict buffers: a plain tensor attribute
    (which tracing lifts into a constant) and a non-persistent buffer, both used in forward;
    and a buffer that forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8, dtype=torch.float64)
        self.scale = torch.arange(8, dtype=torch.float64) / 8 + 0.5
        self.register_buffer("shift", torch.full((8,), 0.25, dtype=torch.float64), persistent=False)
        self.register_buffer("kept", torch.ones(8, dtype=torch.float64))
        self.register_buffer(
            "unused", torch.full((2,), 7.0, dtype=torch.float64)
        )  # no unit reads it
        self.b = nn.Linear(8, 8, dtype=torch.float64)
        self.c = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.scale + self.shift
        return self.c(torch.tanh(self.b(h * self.kept)))


def constants_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return x, y


def constants() -> dict[str, Any]:
    """A model with lifted constants trained one SGD step: the gathered state dict."""
    from autopipe.distributed import DistributedPipeline

    x, y = constants_batch()
    pipe = DistributedPipeline(Constants(), x, loss_fn=loss_fn, chunks=2, schedule="gpipe")
    pipe.step(x, y)
    optimizer = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
    optimizer.step()
    return {
        "state": pipe.gather_state_dict(),
        "own": pipe.state_dict(),
        "balance": pipe.plan.balance,
    }


def construction_calibration(rank: int, world: int) -> dict[str, Any]:
    """Pipelines built on an empty calibration cache: by default nothing is measured;
    ``calibrate=True`` measures once and keeps it; the next pipeline finds it cached."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.distributed.calibration_cache import (
        cached_runner_calibration,
        current_runtime_key,
    )

    x, _ = make_batch()
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    key = current_runtime_key(world)  # one stage per rank, 1F1B: the single-stage runtime

    def entry() -> dict[str, Any] | None:
        return cached_runner_calibration(key)

    result: dict[str, Any] = {}
    plain = DistributedPipeline(make_model(), x, **options)
    result["default"] = (plain.plan.stages[0].overhead, entry())
    measured = DistributedPipeline(make_model(), x, calibrate=True, **options)
    result["measured"] = (measured.plan.stages[0].overhead, entry())
    result["calibration"] = measured.plan.profile["meta"].get("calibration")
    again = DistributedPipeline(make_model(), x, calibrate=True, **options)
    result["again"] = (again.plan.stages[0].overhead, entry())
    try:
        DistributedPipeline(make_model(), x, calibrate="yes", **options)
    except TypeError as exc:
        result["error"] = str(exc)
    return result
