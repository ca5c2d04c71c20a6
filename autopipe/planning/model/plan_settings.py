"""The settings a plan is made under, and the cost model they build from a profile."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any

from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec, make_devices
from autopipe.planning.model.layer_costs import ProfileLines, optimizer_factor
from autopipe.planning.model.mesh import Mesh
from autopipe.planning.model.names import V_SCHEDULES
from autopipe.planning.model.runner_figures import RunnerFigures
from autopipe.planning.pipeline_settings import MemorySpec, PipelineSettings
from profiler import Profile

__all__ = ["MemorySpec", "PlanSettings", "build_model"]

# The settings of a plan are those of the pipeline it is made for.
PlanSettings = PipelineSettings
# One device's lines of a mesh: (profile, its lines, the mesh, the replicas D, the
# all-reduce bandwidth) to lines whose ``at`` gives that device's layer costs.
MeshView = Callable[[Profile, ProfileLines, Mesh, int, "float | None"], Any]


def check_profile(profile: object, caller: str) -> None:
    """Refuses anything but a :class:`Profile` where ``caller()`` takes one.

    Raises:
        TypeError: ``profile`` is a path, a dict or anything else.
    """
    if isinstance(profile, Profile):
        return
    if isinstance(profile, (str, PathLike)):
        raise TypeError(
            f"{caller}() takes a Profile, not the path {str(profile)!r}; load it with "
            f"Profile.load({str(profile)!r})"
        )
    if isinstance(profile, dict):
        raise TypeError(
            f"{caller}() takes a Profile, not a dict; convert it with Profile.from_dict(data)"
        )
    raise TypeError(
        f"{caller}() takes a Profile, got {type(profile).__name__}; measure one with "
        "profiler.profile_model(model, sample) or load one with Profile.load('file.json')"
    )


def _replica_batch(profile: Profile, batch: int | None, data_parallel: int) -> int:
    """Samples per replica: ``ceil(batch / D)``."""
    total = profile.batch_size if batch is None else batch
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"batch must be a positive integer, got {total!r}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int):
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if not 1 <= data_parallel <= total:
        raise ValueError(
            f"data_parallel must be between 1 and the batch ({total}), got {data_parallel}"
        )
    return math.ceil(total / data_parallel)


def build_model(
    profile: Profile,
    devices: int | Sequence[DeviceSpec | str],
    settings: PipelineSettings,
    mesh_view: MeshView | None = None,
) -> CostModel:
    """The cost model :func:`autopipe.plan` optimizes for ``devices`` under ``settings``.

    Settings left ``None`` are resolved by :meth:`PipelineSettings.resolved` (the
    profile's micro-batch count, ``gpipe``, :func:`default_checkpoint`). With
    ``tensor_parallel`` t > 1 the layers are one device's of each stage's t
    (``Mesh(tensor=t)``), as ``mesh_view`` makes them from the profile's lines, the
    replicas and the all-reduce bandwidth (the planner passes
    :func:`autopipe.planning.mesh.degree_figures.uniform_mesh_lines`, which this layer
    cannot import).

    Raises:
        ValueError: invalid settings, or ``tensor_parallel`` > 1 without ``mesh_view``
            or on a profile that cannot price it.
        TypeError: ``profile`` is not a :class:`Profile`, or a setting is of the wrong kind.
    """
    check_profile(profile, "plan")
    figures = RunnerFigures.resolve(
        profile,
        bandwidth=settings.bandwidth,
        allreduce_bandwidth=settings.allreduce_bandwidth,
        overhead=settings.overhead,
    )
    specs = make_devices(
        devices,
        memory=settings.memory,
        bandwidth=figures.bandwidth,
        name=profile.device,
        latency=figures.latency,
    )
    v = settings.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
    if settings.schedule in V_SCHEDULES:  # two stages per rank in a V: devices count 2K
        if v not in (1, 2):
            raise ValueError(
                f"{settings.schedule} runs 2 stages per rank, not virtual_stages={v}; "
                "leave virtual_stages unset or give 2"
            )
        if len(specs) % 2:
            raise ValueError(
                f"{settings.schedule} needs an even number of stages (2 per rank), got "
                f"{len(specs)}; give 2K devices' stages"
            )
        v = 2
    d = 1 if settings.data_parallel is None else settings.data_parallel
    settings = settings.resolved(
        max(1, len(specs) // v), profile.batch_size, profile_chunks=profile.chunks
    )
    m = settings.chunks
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"chunks must be a positive integer, got {m!r}")
    replica = _replica_batch(profile, settings.batch, d)
    micro = math.ceil(replica / m)
    # A mini-batch smaller than M yields fewer, single-sample micro-batches.
    effective = math.ceil(replica / micro)
    if not isinstance(settings.padded, bool):  # "no" would read as True
        raise TypeError(f"padded must be True or False, got {settings.padded!r}")
    if not isinstance(settings.shard_optimizer, bool):
        raise TypeError(f"shard_optimizer must be True or False, got {settings.shard_optimizer!r}")
    if not isinstance(settings.colocated, bool):
        raise TypeError(f"colocated must be True or False, got {settings.colocated!r}")
    mesh = _tensor_mesh(settings.tensor_parallel, mesh_view)
    alone = len(specs) // v * d * mesh.tensor == 1
    lines: ProfileLines | Any = ProfileLines.from_profile(profile, alone)
    if mesh.tensor > 1 and mesh_view is not None:
        lines = mesh_view(profile, lines, mesh, d, figures.allreduce_bandwidth)
    # Micro-batches of uneven size take the mean size's time in all, unless the runner pads
    # each to the largest.
    costs = lines.at(micro, time_batch=micro if settings.padded else replica / effective)
    return figures.cost_model(
        costs,
        specs,
        effective,
        str(settings.checkpoint),
        str(settings.schedule),
        optimizer_factor(settings.optimizer),
        CostOptions(
            data_parallel=d,
            virtual_stages=v,
            shard_optimizer=settings.shard_optimizer,
            colocated=settings.colocated,
            mesh=mesh,
        ),
    )


def _tensor_mesh(degree: object, mesh_view: MeshView | None) -> Mesh:
    """The mesh of a ``tensor_parallel`` setting.

    Raises:
        ValueError: not a positive integer, or above 1 without a view to price it.
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {degree!r}")
    if degree > 1 and mesh_view is None:
        raise ValueError(
            f"tensor_parallel={degree} is priced by autopipe.plan (or evaluate), which "
            "gives build_model its mesh view; call those"
        )
    return Mesh(tensor=degree)
