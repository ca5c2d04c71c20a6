"""Per-unit re-computation on gloo ranks: stages that re-compute single units (checkpoint
``units``), one per rank and interleaved, trained as the plain model is (float64, SGD)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import autopipe
from tests.support.dist_models import make_model, sgd_steps

STEPS = 3
LR = 0.1
CHUNKS = 4
BATCH = 16


class Flags(nn.Module):
    """``tanh``, recording ``(is_checkpointing, is_recomputing)`` at every forward (it saves
    its output, so a re-computed unit containing it runs again in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((autopipe.is_checkpointing(), autopipe.is_recomputing()))
        return torch.tanh(x)


def make_blocks(seed: int = 0) -> nn.Sequential:
    """Eight residual-free MLP blocks of width 8 (hidden 32), float64: each block saves
    more than its input, so re-computing one frees memory (the planner may choose it)."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)) for _ in range(8)]
    return nn.Sequential(*blocks).double()


def make_batchnorm() -> nn.Sequential:
    """The runner tests' model with a BatchNorm1d (layer 3), float64."""
    return make_model(batchnorm=True).double()


def make_dropout(flags: Flags | None = None) -> nn.Sequential:
    """Dropout on both sides of the cut and a recording layer (layer 2), float64."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Dropout(0.3),
        flags or Flags(),
        nn.Linear(16, 16),
        nn.Dropout(0.2),
        nn.Tanh(),
        nn.Linear(16, 8),
        nn.Tanh(),
    ).double()


def bench_blocks() -> tuple[nn.Sequential, Tensor]:
    """The blocks and one batch, for the rank benchmark (a picklable builder)."""
    return make_blocks(), batch()[0]


MODELS: dict[str, Callable[[], nn.Module]] = {
    "blocks": make_blocks,
    "batchnorm": make_batchnorm,
    "dropout": make_dropout,
}


def batch(width_out: int = 8) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, 8, generator=generator, dtype=torch.float64)
    y = torch.randn(BATCH, width_out, generator=generator, dtype=torch.float64)
    return x, y


def mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def _target_width(kind: str) -> int:
    return 3 if kind == "batchnorm" else 8


def reference(kind: str, chunks: int = CHUNKS) -> tuple[list[dict[str, Any]], dict[str, Tensor]]:
    """The plain model's STEPS SGD steps on the mean of ``chunks`` micro-batches' losses
    (BatchNorm statistics from the whole batch, as the pipeline's deferred batch norm keeps
    them) and its state after the last."""
    model = MODELS[kind]()
    x, y = batch(_target_width(kind))
    steps = sgd_steps(model, x, y, mse, chunks, STEPS, LR)
    return steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


def per_micro_batch_reference(kind: str) -> dict[str, Tensor]:
    """The plain model's state after STEPS SGD steps whose BatchNorm layers update their
    running statistics once per micro-batch, as the micro-batches run (no deferral)."""
    model = MODELS[kind]()
    x, y = batch(_target_width(kind))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        pairs = zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS), strict=True)
        torch.stack([mse(model(xb), yb) for xb, yb in pairs]).mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def units_plan(
    kind: str, balance: list[int], units: list[list[int]], schedule: str, virtual: int = 1
) -> autopipe.Plan:
    """A plan of the given split whose stage k re-computes ``units[k]`` (global layer
    indices; an empty list keeps the stage's mode ``never``)."""
    from autopipe.planning import evaluate
    from tests.support.planning_cases import linear_profile

    layers = len(list(MODELS[kind]().children()))
    profile = linear_profile([1.0] * layers)
    options: dict[str, Any] = {"chunks": CHUNKS, "schedule": schedule, "checkpoint": "never"}
    made = evaluate(profile, balance, virtual_stages=virtual, **options)
    for stage, chosen in zip(made.stages, units, strict=True):
        if chosen:
            stage.checkpoint, stage.recompute_units = "units", list(chosen)
    return autopipe.Plan.from_dict(made.to_dict())  # checked as a loaded plan is


def _train(
    kind: str, settings: dict[str, Any], *, seed: int | None = None, model: nn.Module | None = None
) -> dict[str, Any]:
    """STEPS SGD steps of a pipeline: losses, parameters (not of sharded replicas, whose
    are shards), the gathered state, the modes."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.distributed.stage import StageModule

    model = model if model is not None else MODELS[kind]()
    x, y = batch(_target_width(kind))
    pipe = DistributedPipeline(model, x, loss_fn=mse, chunks=CHUNKS, **settings)
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    if seed is not None:  # the same dropout masks in runs that consume the same numbers
        torch.manual_seed(seed + dist.get_rank())
    steps = []
    for _ in range(STEPS):
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        steps.append({"loss": loss, "params": {} if pipe.zero >= 2 else params})
    stages = [m for m in pipe.module.modules() if isinstance(m, StageModule)]
    return {
        "steps": steps,
        "state": pipe.gather_state_dict(),
        "stages": pipe.stage_indices,
        "modes": pipe.plan.stage_checkpoints,
        # This rank's stages as planned: their first layer and re-computed units.
        "planned": [
            (pipe.plan.stages[i].start, pipe.plan.stages[i].recompute_units)
            for i in pipe.stage_indices
        ],
        "checkpointed": [(m.checkpoint, m.units, m.checkpointed) for m in stages],
        "last": pipe.is_last,
    }


def _refusal(kind: str, **settings: Any) -> str:
    from autopipe.distributed import DistributedPipeline

    x, _ = batch(_target_width(kind))
    try:
        DistributedPipeline(MODELS[kind](), x, loss_fn=mse, chunks=CHUNKS, **settings)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return ""


AUTO: dict[str, Any] = {"chunks": CHUNKS, "schedule": "1f1b", "optimizer": "sgd"}


def _auto_plan(profile: Any, stages: int, virtual: int) -> tuple[int, autopipe.Plan] | None:
    """The largest cap (a fraction of the plan's need without re-computation) under which
    ``checkpoint='auto'`` re-computes units on some stage, and its plan; ``None``: none."""
    from autopipe.planning import plan

    options: dict[str, Any] = {**AUTO, "virtual_stages": virtual}
    kept = plan(profile, stages, checkpoint="never", **options)
    need = max(kept.device_memory or [stage.memory for stage in kept.stages])
    for percent in range(99, 20, -2):
        cap = int(need * percent / 100)
        try:
            found = plan(profile, stages, checkpoint="auto", memory=cap, **options)
        except ValueError:
            continue
        if "units" in found.stage_checkpoints:
            return cap, found
    return None


def _planned(world: int) -> dict[int, Any]:
    """Plans made with ``checkpoint='auto'`` and a memory cap: given as ``plan=``, and
    planned by the runner itself from the cap; one stage per rank and two.

    They are planned from the model's profile (measured on rank 0, shared, so that every
    rank plans alike), or where no cap makes that re-compute units, from a made-up one of
    as many layers whose saved tensors dwarf their outputs.
    """
    from profiler import Profile, profile_model
    from tests.support.planning_cases import linear_profile

    x, _ = batch()
    shared: list[Any] = [None]
    if dist.get_rank() == 0:
        measuring = {"chunks": CHUNKS, "warmup": 0, "repeats": 1}
        shared[0] = profile_model(make_blocks(), (x,), **measuring).to_dict()
    dist.broadcast_object_list(shared, src=0)
    measured = Profile.from_dict(shared[0])
    made_up = linear_profile([1.0] * 8, saved=[100] * 8, output=[10] * 8, chunks=CHUNKS,
                             input_bytes=10)  # fmt: skip
    # A calibration of their own: the runner plans from it as plan() does, not from this
    # machine's cached figures of the runner (which would move near ties).
    for profile in (measured, made_up):
        profile.meta.setdefault("calibration", {"overhead_s": 0.0})
    results: dict[int, Any] = {}
    for virtual in (1, 2):
        tries = ((name, profile, _auto_plan(profile, world * virtual, virtual))
                 for name, profile in (("measured", measured), ("made up", made_up)))  # fmt: skip
        found = next(((n, pr, chosen) for n, pr, chosen in tries if chosen is not None), None)
        if found is None:
            results[virtual] = None
            continue
        source, profile, (cap, made) = found
        common = {"schedule": "1f1b", "virtual_stages": virtual, "optimizer": "sgd"}
        given = _train("blocks", {"plan": made, **common})
        own = _train("blocks", {"checkpoint": "auto", "memory": cap, "profile": profile, **common})
        modes = made.stage_checkpoints
        results[virtual] = {"given": given, "own": own, "planned": modes, "source": source}
    return results


def unit_recompute(world: int) -> dict[Any, Any]:
    """Every run of the scenario on this rank, and the refusals' messages."""
    results: dict[Any, Any] = {}
    # (a) units on both stages, under 1f1b, gpipe and zero bubble (whose split backward
    # re-computes a unit for each half); and units beside a whole-stage mode.
    for schedule in ("1f1b", "gpipe", "zb"):
        made = units_plan("blocks", [4, 4], [[0, 2, 3], [4, 7]], schedule)
        results["blocks", schedule] = _train("blocks", {"plan": made, "schedule": schedule})
    mixed = units_plan("blocks", [5, 3], [[1, 4], []], "1f1b")
    mixed.stages[1].checkpoint = "except_last"
    results["blocks", "mixed"] = _train("blocks", {"plan": mixed, "schedule": "1f1b"})
    print("trained the blocks", flush=True)
    # (b) BatchNorm re-computed: statistics deferred (the default) and per micro-batch.
    bn = units_plan("batchnorm", [4, 4], [[2, 3], [4, 7]], "1f1b")
    results["batchnorm", "deferred"] = _train("batchnorm", {"plan": bn, "schedule": "1f1b"})
    results["batchnorm", "per micro-batch"] = _train(
        "batchnorm", {"plan": bn, "schedule": "1f1b", "deferred_batch_norm": False}
    )
    # Dropout re-computed, against the same pipeline keeping everything (same seeds).
    runs: list[tuple[str, list[list[int]]]] = [("never", [[], []]), ("units", [[1, 2], [4, 5]])]
    for label, chosen in runs:
        flags = Flags()
        made = units_plan("dropout", [4, 4], chosen, "gpipe")
        run = _train("dropout", {"plan": made, "schedule": "gpipe"}, seed=7,
                     model=make_dropout(flags))  # fmt: skip
        run["flags"] = flags.seen if dist.get_rank() == 0 else None
        results["dropout", label] = run
    print("trained batch norm and dropout", flush=True)
    # (c) interleaved virtual stages, v = 2.
    for schedule in ("1f1b", "gpipe"):
        made = units_plan("blocks", [2] * 4, [[0], [3], [4, 5], [7]], schedule, virtual=2)
        settings = {"plan": made, "schedule": schedule, "virtual_stages": 2}
        results["blocks v2", schedule] = _train("blocks", settings)
    made = units_plan("batchnorm", [2] * 4, [[1], [3], [], [6, 7]], "1f1b", virtual=2)
    results["batchnorm v2", "1f1b"] = _train(
        "batchnorm", {"plan": made, "schedule": "1f1b", "virtual_stages": 2}
    )
    print("trained virtual stages", flush=True)
    # (d) plans made with checkpoint="auto" and a memory cap.
    results["planned"] = _planned(world)
    print("trained the planned runs", flush=True)
    # Replicas sharded (ZeRO-3, one FSDP unit per unit): one stage of two replicas.
    sharded = units_plan("blocks", [8], [[0, 3, 5]], "1f1b")
    sharded.data_parallel = world
    settings = {"plan": sharded, "schedule": "1f1b", "data_parallel": world, "zero": 3}
    results["blocks", "zero 3"] = _train("blocks", settings)
    # (e) refusals, the same on every rank.
    good = units_plan("blocks", [4, 4], [[0], [5]], "1f1b")
    interleaved = units_plan("blocks", [2] * 4, [[], [3], [], []], "1f1b", virtual=2)
    empty, outside, auto = copy.deepcopy(good), copy.deepcopy(good), copy.deepcopy(good)
    empty.stages[1].recompute_units = []
    outside.stages[1].recompute_units = [2]
    auto.stages[0].checkpoint, auto.stages[0].recompute_units = "auto", []
    results["errors"] = {
        "setting": _refusal("blocks", schedule="1f1b", checkpoint="units"),
        "empty": _refusal("blocks", schedule="1f1b", plan=empty),
        "outside": _refusal("blocks", schedule="1f1b", plan=outside),
        "auto": _refusal("blocks", schedule="1f1b", plan=auto),
        "zbv": _refusal("blocks", schedule="zbv", plan=interleaved),
    }
    return results
