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

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe import PlanningError
from autopipe.distributed.calibration import calibrate_ranks
from autopipe.distributed.collectives import rank_device, share_from_rank0
from autopipe.distributed.prepared import Prepared, prepare_model
from autopipe.distributed.tied_gradients import written_shared
from autopipe.planning import (
    PipelineSettings,
    Plan,
    SearchOptions,
    keep_together,
    search,
    with_overrides,
)
from profiler import Profile, doubling_batch_sizes, profile_model, smallest_batch

__all__: list[str] = []


def _sizes(batch: int, model: nn.Module) -> list[int]:
    """The search's range of micro-batch sizes (from 2 with batch norm, which cannot train
    on one sample)."""
    return doubling_batch_sizes(batch, smallest_batch([model]))


# What the keywords of :func:`search_plan` may set: the settings and the search options
# it searched under before it took them whole. The rest is the runner's: the batch is the
# sample's, and only configurations that split it evenly are weighed.
_SETTINGS = frozenset({"memory", "optimizer"})
_OPTIONS = frozenset({"schedules", "checkpoints", "virtual_stages"})


def search_plan(
    model: nn.Module,
    sample: Tensor | tuple[Tensor, ...],
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    profile: Profile | None = None,
    calibrate: bool = False,
    settings: PipelineSettings | None = None,
    options: SearchOptions | None = None,
    **overrides: Any,
) -> Plan:
    """The fastest configuration of this group's ranks for ``model``; a collective.

    Args:
        model: the model (an ``nn.Sequential``, or one :mod:`autopipe.graph.sequential` can split).
        sample: the global mini-batch a step will take.
        group: the process group (default: the world); a plan uses all its ranks.
        device: where rank 0 profiles (default: the device the ranks run on,
            :func:`autopipe.distributed.collectives.rank_device`).
        profile: a profile of the model's layers to search from instead of profiling.
        calibrate: measure links, runner overhead and compute with every rank busy first
            (``calibrate_ranks``; with ``virtual_stages`` above 1, their runner too).
        settings: the settings the search reads (``SEARCH_SETTINGS`` of
            :mod:`autopipe.planning.configuration.config_search`); the batch is the
            sample's.
        options: the search's ``SearchOptions``; ``even`` and ``top`` are the runner's
            (configurations that split the batch evenly, the best 200 weighed).
        **overrides: laid over those two: ``memory`` (each device's capacity, bytes or
            ``"16GiB"``), ``optimizer`` (whose state is counted), ``schedules`` and
            ``checkpoints`` (to consider), ``virtual_stages`` (stages per device to
            consider; one is always searched).

    Returns:
        The plan, the same on every rank: its ``chunks``, ``schedule``, ``data_parallel``
        and ``virtual_stages`` are the configuration to build the pipeline with.

    Raises:
        TypeError: ``settings`` or ``options`` of another type, or another keyword.
        ValueError: no configuration of the group's size fits (on every rank).
    """
    return search_prepared(
        prepare_model(model, sample),
        group=group,
        device=device,
        profile=profile,
        calibrate=calibrate,
        settings=settings,
        options=options,
        **overrides,
    )


def _inputs(
    settings: PipelineSettings | None,
    options: SearchOptions | None,
    overrides: dict[str, Any],
) -> tuple[PipelineSettings, SearchOptions]:
    """The settings and the search options :func:`search_plan` searches under."""
    if options is not None and not isinstance(options, SearchOptions):
        raise TypeError(
            f"search_plan() takes options=SearchOptions(...), got {type(options).__name__}"
        )
    rest = {k: v for k, v in overrides.items() if k not in _OPTIONS}
    chosen = with_overrides(settings, rest, "search_plan", _SETTINGS | _OPTIONS)
    mine = {k: v for k, v in overrides.items() if k in _OPTIONS}
    return chosen, replace(options or SearchOptions(), **mine)


def search_prepared(
    prepared: Prepared,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    profile: Profile | None = None,
    calibrate: bool = False,
    settings: PipelineSettings | None = None,
    options: SearchOptions | None = None,
    **overrides: Any,
) -> Plan:
    """:func:`search_plan` of a model already made ready for stages (``prepare_model``),
    so that building the pipeline afterwards does not trace it again; a collective."""
    chosen, opts = _inputs(settings, options, overrides)
    world = dist.get_world_size(group)
    tensors = (prepared.sample,) if isinstance(prepared.sample, Tensor) else prepared.sample
    batch = int(tensors[0].shape[0])
    here = torch.device(device) if device is not None else rank_device(group)
    if profile is None:

        def measure() -> dict[str, Any]:
            return profile_model(
                prepared.sequential,
                (prepared.sample,),  # the first layer's one argument
                device=here,
                batch_sizes=_sizes(batch, prepared.sequential),
                owner=prepared.owner if prepared.owner is not None else prepared.sequential,
            ).to_dict()

        what, failed = "receive the profile from rank 0", "rank 0 could not profile the model"
        profile = Profile.from_dict(share_from_rank0(measure, group, what=what, failed=failed))
    if calibrate:
        calibrate_ranks(
            profile,
            group,
            model=prepared.sequential,
            sample=(prepared.sample,),
            virtual_stages=max(opts.virtual_stages),
        )
    # Each rank holds a copy of what its stages use: a written buffer's users stay on one.
    owner = prepared.owner if prepared.owner is not None else prepared.sequential
    written = written_shared(list(prepared.sequential), prepared.written, owner)
    found = keep_together(profile, written)
    # Replicas and micro-batches that split the batch exactly: every model runs so
    # (padding rows would enter BatchNorm's statistics), and the sample is global.
    exact = (replace(chosen, batch=batch), replace(opts, even=True, top=200))

    def best() -> dict[str, Any]:
        return _best(found, world, *exact)

    what, failed = "receive the plan from rank 0", "rank 0 found no configuration"
    return Plan.from_dict(share_from_rank0(best, group, what=what, failed=failed))


def _best(
    profile: Profile, world: int, settings: PipelineSettings, options: SearchOptions
) -> dict[str, Any]:
    """The fastest configuration using exactly ``world`` devices, as a plan's dict.

    Raises:
        PlanningError: none fits, or every one that fits uses fewer devices.
    """
    found = search(profile, world, settings, options)
    exact = [plan for plan in found if plan.num_devices == world]
    if not exact:
        best = found[0]
        raise PlanningError(
            f"every fitting configuration among the best uses fewer than {world} devices "
            f"(the best: {best.num_devices}); run on fewer ranks"
        )
    return exact[0].to_dict()
