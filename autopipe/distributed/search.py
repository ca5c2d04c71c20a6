"""The configuration of a distributed pipeline chosen by :func:`autopipe.search`, on all ranks.

:func:`search_plan` is what :meth:`autopipe.distributed.DistributedPipeline.from_search`
runs before building the pipeline: rank 0 profiles the model at micro-batch sizes from one
sample to the whole batch, every rank optionally calibrates the links and the runner
(:func:`autopipe.distributed.calibration.calibrate_ranks`), and rank 0 searches the pipeline
depth K, data-parallel width D (K·D = the group's size), micro-batches, checkpointing,
schedule and stages per device, among those that split the batch into equal replicas and
micro-batches, then hands the best plan to every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.distributed.prepared import prepare_model
from autopipe.distributed.setup import collective
from autopipe.errors import PlanningError
from autopipe.planning.plans import Plan
from profiler.measure import doubling_batch_sizes
from profiler.profile import Profile

__all__ = ["search_plan"]


def _sizes(batch: int, model: nn.Module) -> list[int]:
    """The search's range of micro-batch sizes (from 2 with batch norm, which cannot train
    on one sample)."""
    norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return doubling_batch_sizes(batch, 2 if norm else 1)


def search_plan(
    model: nn.Module,
    sample: Tensor | tuple[Tensor, ...],
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    profile: Profile | None = None,
    calibrate: bool = False,
    memory: int | str | None = None,
    schedules: Sequence[str] = ("gpipe", "1f1b"),
    checkpoints: Sequence[str] = ("never", "except_last", "always", "auto"),
    virtual_stages: Sequence[int] = (1,),
    optimizer: str | float = "adam",
) -> Plan:
    """The fastest configuration of this group's ranks for ``model``; a collective.

    Args:
        model: the model (an ``nn.Sequential``, or one :mod:`autopipe.gpipe.wrap` can split).
        sample: the global mini-batch a step will take.
        group: the process group (default: the world); a plan uses all its ranks.
        device: where rank 0 profiles (default: the CPU, or the current CUDA device).
        profile: a profile of the model's layers to search from instead of profiling.
        calibrate: measure links, runner overhead and compute with every rank busy first
            (``calibrate_ranks``; with ``virtual_stages`` above 1, their runner too).
        memory: each device's capacity (bytes or ``"16GiB"``).
        schedules: schedules to consider.
        checkpoints: checkpoint modes to consider.
        virtual_stages: stages per device to consider (one is always searched).
        optimizer: optimizer whose state is counted.

    Returns:
        The plan, the same on every rank: its ``chunks``, ``schedule``, ``data_parallel``
        and ``virtual_stages`` are the configuration to build the pipeline with.

    Raises:
        ValueError: no configuration of the group's size fits (on every rank).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prepared = prepare_model(model, sample)
    tensors = (prepared.sample,) if isinstance(prepared.sample, Tensor) else prepared.sample
    batch = int(tensors[0].shape[0])
    here = torch.device(device) if device is not None else _default_device()
    shared: list[Any] = [None]
    if rank == 0 and profile is None:
        from profiler.measure import profile_model

        found = profile_model(
            prepared.sequential,
            (prepared.sample,),  # the first layer's one argument
            device=here,
            batch_sizes=_sizes(batch, prepared.sequential),
        )
        shared[0] = found.to_dict()
    source = dist.get_global_rank(group or dist.group.WORLD, 0)  # type: ignore[arg-type]
    if profile is None:
        what = "receive the profile from rank 0"
        collective(rank, what, dist.broadcast_object_list, shared, src=source, group=group)
        profile = Profile.from_dict(shared[0])
    if calibrate:
        from autopipe.distributed.calibration import calibrate_ranks

        calibrate_ranks(
            profile,
            group,
            model=prepared.sequential,
            sample=(prepared.sample,),
            virtual_stages=max(virtual_stages),
        )
    result: list[Any] = [None]
    if rank == 0:
        result[0] = _best(
            profile,
            world,
            batch,
            memory=memory,
            schedules=schedules,
            checkpoints=checkpoints,
            virtual_stages=virtual_stages,
            optimizer=optimizer,
        )
    collective(rank, "receive the plan from rank 0", dist.broadcast_object_list, result,
               src=source, group=group)  # fmt: skip
    kind, value = result[0]
    if kind == "error":
        raise ValueError(f"rank 0 found no configuration: {value}")
    return Plan.from_dict(value)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _best(profile: Profile, world: int, batch: int, **options: Any) -> tuple[str, Any]:
    """``("plan", dict)`` of the fastest configuration using exactly ``world`` devices, or
    ``("error", message)``."""
    from autopipe.planning.config_search import search

    try:
        # Replicas and micro-batches that split the batch exactly: every model runs so
        # (padding rows would enter BatchNorm's statistics), and the sample is global.
        found = search(profile, world, batch=batch, even=True, top=200, **options)
    except (PlanningError, ValueError) as exc:
        return "error", str(exc)
    exact = [plan for plan in found if plan.num_devices == world]
    if not exact:
        best = found[0]
        return "error", (
            f"every fitting configuration among the best uses fewer than {world} devices "
            f"(the best: {best.num_devices}); run on fewer ranks"
        )
    return "plan", exact[0].to_dict()
