"""The runner's calibration, measured once per machine and runtime and kept on disk.

What the runner itself costs — its fixed seconds per stage and micro-batch and the
latency and bandwidth of a message between neighbouring ranks — belongs to the host, the
backend, the number of ranks, the threads each rank computes with and torch's runtime
for the schedule, not to the model. :func:`calibrate_ranks` measures it in a few
seconds; this module keeps what it found under a key of those conditions, so that every
later plan for the same runner (``autopipe bench --ranks``, a ``DistributedPipeline``
that plans) starts calibrated without measuring again.

The file is ``calibration.json`` in the profile cache's folder (``$AUTOPIPE_CACHE_DIR``), one
entry per key, written atomically.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from profiler import Profile, cache_dir, cpu_model, read_json, store_calibration, write_json

__all__ = [
    "apply_runner_calibration",
    "cache_file",
    "cached_runner_calibration",
    "runtime_key",
    "save_runner_calibration",
]

# The figures of the runner, not of a model, that a cache entry holds.
RUNNER_FIGURES = ("overhead_s", "virtual_overhead_s", "latency_s", "bandwidth")
_KIND = "autopipe calibration cache"


def cache_file() -> Path:
    """Where the cache lives: ``calibration.json`` in :func:`profiler.cache_folder.cache_dir`
    (``$AUTOPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopipe``, else ``~/.cache/autopipe``)."""
    return cache_dir() / "calibration.json"


def runtime_key(
    *,
    backend: str,
    ranks: int,
    threads: int,
    bound: bool,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
) -> str:
    """The conditions a runner calibration holds for, as one string.

    Args:
        backend: ``gloo`` or ``nccl``.
        ranks: ranks of one pipeline on this host.
        threads: torch threads each rank computes with.
        bound: whether each rank is bound to its own CPUs.
        schedule: the schedule; it matters only where torch runs virtual stages or zero
            bubble on its multi-stage runtime (``virtual_stages > 1`` or ``zb``).
        virtual_stages: stages per rank.
    """
    multi = virtual_stages > 1 or schedule == "zb"
    conditions = {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count() or 0,
        "torch": torch.__version__,
        "backend": backend,
        "ranks": ranks,
        "threads": threads,
        "bound": bound,
        "runtime": f"multi-stage {schedule} v={virtual_stages}" if multi else "single-stage",
    }
    return json.dumps(conditions, sort_keys=True)


def current_runtime_key(ranks: int, schedule: str = "1f1b", virtual_stages: int = 1) -> str:
    """:func:`runtime_key` of this rank's process group and process: its backend, its
    torch threads, and whether it is bound to fewer CPUs than the host has."""
    import torch.distributed as dist

    cpus = os.cpu_count() or 0
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    return runtime_key(
        backend=str(dist.get_backend()),
        ranks=ranks,
        threads=torch.get_num_threads(),
        bound=mine < cpus,
        schedule=schedule,
        virtual_stages=virtual_stages,
    )


def _entries(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        found = read_json(path, _KIND).get("entries")
    except ValueError:  # a damaged cache is measured again, not an error
        return {}
    return found if isinstance(found, dict) else {}


def cached_runner_calibration(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The figures saved under ``key`` (with ``measured_at``, seconds since the epoch),
    or ``None`` when there are none."""
    entry = _entries(path or cache_file()).get(key)
    if not isinstance(entry, dict):
        return None
    values = {k: entry[k] for k in RUNNER_FIGURES if isinstance(entry.get(k), (int, float))}
    if "overhead_s" not in values:
        return None
    values["measured_at"] = entry.get("measured_at")
    return values


def save_runner_calibration(
    key: str, values: Mapping[str, Any], path: Path | None = None
) -> dict[str, Any]:
    """Keeps the runner's figures of ``values`` (a calibration) under ``key``.

    Returns:
        The entry saved. A cache that cannot be written is left as it is: the plan then
        stays calibrated for this run only.
    """
    target = path or cache_file()
    entry: dict[str, Any] = {k: float(values[k]) for k in RUNNER_FIGURES if k in values}
    entry["measured_at"] = time.time()
    entries = _entries(target)
    entries[key] = entry
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json(target, _KIND, {"entries": entries})
    except OSError:
        pass
    return entry


def apply_runner_calibration(profile: Profile, values: Mapping[str, Any]) -> dict[str, Any]:
    """Stores the runner's figures of ``values`` in ``profile``'s calibration, keeping what
    was calibrated for the model itself (its compute scales)."""
    figures = {k: float(values[k]) for k in RUNNER_FIGURES if k in values}
    return store_calibration(profile, **figures)
