"""autopipe: automatic, provably balanced pipeline parallelism for PyTorch.

Layers, each a subpackage, from the bottom up, on :mod:`profiler` (the measurements):
:mod:`autopipe.planning` (pure numbers, no torch); :mod:`autopipe.graph` (any module cut
into units) beside :mod:`autopipe.output` (reports, timelines, traces);
:mod:`autopipe.microbatching` (what both runners need to train micro-batches like the whole
batch); :mod:`autopipe.gpipe` (one process), :mod:`autopipe.distributed` (torch
pipelining) and :mod:`autopipe.balance` (torchgpipe's measuring balancers); and
:mod:`autopipe.cli`. Every name below loads on first use, so ``import autopipe`` costs
nothing and planning never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopipe.distributed import DistributedPipeline
    from autopipe.errors import PlanningError
    from autopipe.gpipe import GPipe, WrappedPipeline, wrap
    from autopipe.microbatching import is_checkpointing, is_recomputing
    from autopipe.planning import DeviceSpec, Plan, StagePlan, make_devices, partition, plan, search
    from profiler.profile import LayerProfile, Profile

__version__ = "0.1.0"

__all__ = [
    "DeviceSpec",
    "DistributedPipeline",
    "GPipe",
    "LayerProfile",
    "Plan",
    "PlanningError",
    "Profile",
    "StagePlan",
    "WrappedPipeline",
    "is_checkpointing",
    "is_recomputing",
    "make_devices",
    "partition",
    "plan",
    "search",
    "wrap",
]

_HOMES = {
    "DeviceSpec": "autopipe.planning",
    "DistributedPipeline": "autopipe.distributed",
    "GPipe": "autopipe.gpipe",
    "LayerProfile": "profiler.profile",
    "Plan": "autopipe.planning",
    "PlanningError": "autopipe.errors",
    "Profile": "profiler.profile",
    "StagePlan": "autopipe.planning",
    "WrappedPipeline": "autopipe.gpipe",
    "is_checkpointing": "autopipe.microbatching",
    "is_recomputing": "autopipe.microbatching",
    "make_devices": "autopipe.planning",
    "partition": "autopipe.planning",
    "plan": "autopipe.planning",
    "search": "autopipe.planning",
    "wrap": "autopipe.gpipe",
}


# Modules under a short name: ``autopipe.timeline.trace(plan)``; ``autopipe.balance`` is
# the package itself, loaded on first use like the names above.
_MODULES = {"balance": "autopipe.balance", "timeline": "autopipe.output.timeline"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        module = importlib.import_module(_MODULES[name])
        globals()[name] = module
        return module
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'autopipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_MODULES})
