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

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe.distributed import DistributedPipeline
    from autopipe.errors import ModelFileError, PlanningError, TracingError
    from autopipe.gpipe import GPipe, WrappedPipeline, wrap
    from autopipe.microbatching import is_checkpointing, is_recomputing
    from autopipe.planning import DeviceSpec, Plan, StagePlan, make_devices, partition, plan, search
    from profiler import LayerProfile, Profile

__all__ = [
    "DeviceSpec",
    "DistributedPipeline",
    "GPipe",
    "LayerProfile",
    "ModelFileError",
    "Plan",
    "PlanningError",
    "Profile",
    "StagePlan",
    "TracingError",
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
    "LayerProfile": "profiler",
    "ModelFileError": "autopipe.errors",
    "Plan": "autopipe.planning",
    "PlanningError": "autopipe.errors",
    "Profile": "profiler",
    "StagePlan": "autopipe.planning",
    "TracingError": "autopipe.errors",
    "WrappedPipeline": "autopipe.gpipe",
    "is_checkpointing": "autopipe.microbatching",
    "is_recomputing": "autopipe.microbatching",
    "make_devices": "autopipe.planning",
    "partition": "autopipe.planning",
    "plan": "autopipe.planning",
    "search": "autopipe.planning",
    "wrap": "autopipe.gpipe",
}

__version__ = "0.1.0"


# Modules under a short name: ``autopipe.timeline.trace(plan)``; ``autopipe.balance`` is
# the package itself, loaded on first use like the names above.
_MODULES = {"balance": "autopipe.balance", "timeline": "autopipe.output.timeline"}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES, _MODULES)
