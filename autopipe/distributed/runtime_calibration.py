"""The runner's calibration measured while the ranks build a pipeline (``calibrate=True``).

:func:`autopipe.distributed.calibration.calibrate_ranks` (``autopipe calibrate``,
``autopipe bench --ranks``) measures the links and the runner's fixed cost and keeps the
runner's figures in this machine's cache (:mod:`autopipe.distributed.calibration_cache`);
a :class:`~autopipe.distributed.DistributedPipeline` that plans applies a cached entry
when its profile has none. Every rank constructs the pipeline together, so the same
figures can be measured there when no entry exists yet: once, collectively, on each
replica's pipeline group, before rank 0 plans, and kept in the cache for every later
pipeline of the same runtime. Only what the cache holds is measured (links, the runner's
overhead); the gradient all-reduce is not, and the compute scales are the profile's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autopipe.distributed.calibration import measure_p2p, measure_runner_overhead
from autopipe.distributed.calibration_cache import (
    cached_runner_calibration,
    current_runtime_key,
    save_runner_calibration,
)
from autopipe.distributed.collectives import share_from_rank0
from profiler import Profile

if TYPE_CHECKING:
    from autopipe.distributed.runner import PipelineRunner

__all__: list[str] = []


def _calibrated(profile: Any) -> bool:
    """Whether a given profile (or its dict) holds a calibration of the runner."""
    meta = profile.meta if isinstance(profile, Profile) else (profile or {}).get("meta", {})
    found = meta.get("calibration") if isinstance(meta, Mapping) else None
    return isinstance(found, Mapping) and "overhead_s" in found


def measure_uncached_runtime(runner: PipelineRunner, profile: Any) -> dict[str, float] | None:
    """Measures the runner's figures for this runtime unless rank 0's cache has them; a
    collective of ``runner.group``, called by every rank after the ranks agreed on the
    arguments (the layout is known) and before rank 0 plans.

    Rank 0 decides for all: nothing is measured when the given ``profile`` is calibrated
    or the cache holds an entry for the runtime's key (the ranks of one pipeline, the
    backend, threads, CPU binding, and the schedule where torch runs it on its
    multi-stage runtime). Otherwise each replica's pipeline group times messages between
    its first two ranks and steps of a tiny pipeline of the same schedule and stages per
    rank, all at once, and rank 0 keeps replica 0's figures in the cache.

    Returns:
        The figures measured (``latency_s``, ``bandwidth``, ``overhead_s``, and
        ``virtual_overhead_s`` for virtual stages or zero bubble), the same on every rank,
        or ``None`` when nothing was measured.
    """
    layout = runner.layout
    k, schedule, v = layout.num_stages, runner.schedule_name, runner.virtual_stages
    key = current_runtime_key(k, schedule, v) if runner.rank == 0 else ""

    def needed() -> bool:
        return not _calibrated(profile) and cached_runner_calibration(key) is None

    what, failed = "hear from rank 0 whether to calibrate", "rank 0 could not read its cache"
    if not share_from_rank0(needed, runner.group, what=what, failed=failed):
        return None
    group = layout.pipeline
    figures: dict[str, float] = {"latency_s": 0.0}
    if k > 1:  # a single stage sends nothing
        link = measure_p2p(group)
        figures = {"latency_s": float(link["latency_s"]), "bandwidth": float(link["bandwidth"])}
    multi = v > 1 or schedule == "zb"  # torch's multi-stage runtime, with its own cost
    overhead = measure_runner_overhead(
        group,
        latency=figures["latency_s"],
        schedule=schedule if multi else "1f1b",
        virtual_stages=v,
    )
    figures["overhead_s"] = float(overhead["overhead_s"])
    if multi:
        figures["virtual_overhead_s"] = figures["overhead_s"]
    # Replica 0's figures on every rank, as rank 0 plans with them.
    what, failed = "receive the runner's figures from rank 0", "rank 0 could not share them"
    measured = share_from_rank0(lambda: figures, runner.group, what=what, failed=failed)
    if runner.rank == 0:
        save_runner_calibration(key, measured)
    return measured
