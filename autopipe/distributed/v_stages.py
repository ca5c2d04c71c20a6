"""V-shaped placement: 2K stages on K ranks, rank r holding stages r and 2K−1−r.

torch's ``ScheduleZBVZeroBubble`` (``zbv``) and ``ScheduleDualPipeV`` (``dualpipev``) run
a pipeline of K ranks as 2K contiguous stages folded into a V: rank r holds stage r on the
way down and stage 2K−1−r on the way back, so rank 0 holds both the first stage (it reads
the inputs) and the last (it reads the targets and computes the loss), and an embedding on
stage 0 and a head on stage 2K−1 share a rank. This module holds the placement and torch's
constraints on it, as plain functions the runner and its checks call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from autopipe.distributed.stage import split_backward_problem
from autopipe.planning import Plan, evaluate

__all__: list[str] = []

# Both run exactly two stages per rank, given in the rank's stage order (r, 2K−1−r).
V_SCHEDULES: dict[str, type[PipelineScheduleMulti]] = {
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def is_v_schedule(name: object) -> bool:
    """Whether ``name`` is a V-shaped schedule (``zbv`` or ``dualpipev``)."""
    return isinstance(name, str) and name in V_SCHEDULES


def v_stage_indices(position: int, ranks: int) -> list[int]:
    """The two stages of the rank at pipeline ``position`` of ``ranks``: r and 2K−1−r."""
    if not 0 <= position < ranks:
        raise ValueError(f"position {position} is not a rank of a {ranks}-rank pipeline")
    return [position, 2 * ranks - 1 - position]


def v_stage_rank(stage: int, ranks: int) -> int:
    """The pipeline position holding ``stage`` of the 2K stages on ``ranks`` ranks."""
    if not 0 <= stage < 2 * ranks:
        raise ValueError(f"stage {stage} is not one of the {2 * ranks} stages of {ranks} ranks")
    return stage if stage < ranks else 2 * ranks - 1 - stage


def v_stage_ranks(ranks: int) -> list[int]:
    """The pipeline position of every stage, in stage order 0..2K−1 (torch's ``style="v"``)."""
    return [v_stage_rank(stage, ranks) for stage in range(2 * ranks)]


def v_settings(settings: Any, balance: Sequence[int] | None) -> Any:
    """``settings`` as a V schedule runs them: two stages per rank and no re-computation
    unless set otherwise (refused then by :func:`check_v_sizes`); others as they are.

    Raises:
        ValueError: ``balance`` is given for a schedule that is not a V schedule.
    """
    if not is_v_schedule(settings.schedule):
        if balance is not None:
            raise ValueError(
                f"balance= splits the stages of a V schedule (zbv, dualpipev), not of "
                f"{settings.schedule or '1f1b'!r}; pass plan= instead"
            )
        return settings
    virtual = settings.virtual_stages if settings.virtual_stages != 1 else 2
    checkpoint = settings.checkpoint or "never"
    return dataclasses.replace(settings, virtual_stages=virtual, checkpoint=checkpoint)


def stage_positions(schedule: str, ranks: int) -> int | list[int]:
    """Where a pipeline's stages run, as :mod:`autopipe.distributed.tied_gradients` takes it:
    every stage's position under a V schedule, else K (stage s on position s % K)."""
    return v_stage_ranks(ranks) if is_v_schedule(schedule) else ranks


def v_plan(
    profile: Any,
    balance: Sequence[int] | None,
    stages: int,
    settings: tuple[Any, int, Any],
) -> Plan:
    """The plan of a V pipeline of ``stages`` (2K) stages, in stage order.

    Args:
        profile: the pipeline's profile.
        balance: the given split of the 2K stages, or ``None`` for an even split by layer
            count, larger stages first (torch's).
        stages: 2K.
        settings: the schedule's name, the micro-batches and the optimizer (or ``None``).
    """
    schedule, chunks, optimizer = settings
    options: dict[str, Any] = {
        "chunks": chunks,
        "schedule": schedule,
        "virtual_stages": 2,
        "checkpoint": "never",
    }
    if optimizer is not None:
        options["optimizer"] = optimizer
    # The optimal V split can cut where a stage sends a non-contiguous tensor, which torch's
    # V schedules refuse to send; until the stages make their outputs contiguous, the
    # default is torch's own even split, priced by the V schedule's replay.
    layers = len(profile.layers)
    if stages < 1 or layers < stages:
        raise ValueError(f"cannot split {layers} layers into {stages} stages")
    size, extra = divmod(layers, stages)
    even = [size + (index < extra) for index in range(stages)]
    return evaluate(profile, list(balance) if balance is not None else even, **options)


def check_v_sizes(
    name: str,
    ranks: int,
    layers: int,
    chunks: int,
    balance: Sequence[int] | None = None,
    *,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    virtual_stages: int = 1,
    checkpoint: str = "never",
) -> None:
    """Checks that a V schedule can run this pipeline; one line per refusal.

    Torch runs the V schedules with exactly two stages per rank; ``dualpipev`` needs at
    least as many micro-batches as stages (M ≥ 2K), and ``zbv`` is held to the same bound
    (its steady state pairs every stage's forward with a backward).

    Args:
        name: ``zbv`` or ``dualpipev``.
        ranks: the ranks of one pipeline (K).
        layers: the model's layers.
        chunks: micro-batches per mini-batch (M).
        balance: layers per stage in stage order 0..2K−1, or ``None`` for an even split.
        data_parallel: replicas (D); only 1.
        tensor_parallel: tensor-parallel ranks per stage; only 1.
        virtual_stages: stages per rank as given; 1 (unset) or 2.
        checkpoint: re-materialization; only ``never`` (torch's split backward re-runs a
            checkpointed forward in each of its parts: :func:`split_backward_problem`).

    Raises:
        ValueError: the schedule cannot run these sizes.
    """
    if not is_v_schedule(name):
        raise ValueError(f"{name!r} is not a V schedule: choose {', '.join(V_SCHEDULES)}")
    stages = 2 * ranks
    if virtual_stages not in (1, 2):
        raise ValueError(
            f"{name} runs exactly 2 stages per rank, not virtual_stages={virtual_stages}; "
            "leave virtual_stages unset"
        )
    split = split_backward_problem(name, checkpoint)
    if split is not None:
        raise ValueError(f"{split}; use checkpoint='never' (the default for V schedules)")
    if data_parallel != 1 or tensor_parallel != 1:
        raise ValueError(
            f"{name} runs one pipeline without replicas or tensor parallelism; got "
            f"data_parallel={data_parallel}, tensor_parallel={tensor_parallel} (use 1, or "
            "schedule='1f1b')"
        )
    if balance is not None:
        if len(balance) != stages:
            raise ValueError(
                f"{name} on {ranks} ranks runs 2K = {stages} stages but the balance has "
                f"{len(balance)} entries; give {stages}, in stage order 0..{stages - 1}"
            )
        if any(size < 1 for size in balance) or sum(balance) != layers:
            raise ValueError(
                f"the balance {list(balance)} must give every stage at least one layer and "
                f"split the model's {layers} layers"
            )
    elif layers < stages:
        raise ValueError(f"cannot split {layers} layers into {stages} stages (2 per rank)")
    if chunks < stages:
        raise ValueError(
            f"{name} needs at least as many micro-batches as stages: chunks={chunks} for "
            f"2K = {stages} stages on {ranks} ranks; use chunks >= {stages}"
        )
