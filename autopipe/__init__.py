"""autopipe: automatic, provably balanced pipeline parallelism for PyTorch.

The planner (``partition``, ``plan``, ``Plan``) imports no torch; the executors load torch
only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopipe.balance import partition
from autopipe.devices import DeviceSpec, make_devices
from autopipe.errors import PlanningError
from autopipe.planner import plan
from autopipe.plans import Plan, StagePlan
from autopipe.search import search
from profiler.profile import LayerProfile, Profile

if TYPE_CHECKING:
    from autopipe.distributed import DistributedPipeline
    from autopipe.gpipe import GPipe
    from autopipe.wrapped import WrappedPipeline
    from autopipe.wrapping import wrap

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
    "make_devices",
    "partition",
    "plan",
    "search",
    "wrap",
]

_LAZY = {
    "DistributedPipeline": "autopipe.distributed",
    "GPipe": "autopipe.gpipe",
    "WrappedPipeline": "autopipe.wrapped",
    "wrap": "autopipe.wrapping",
}


def __getattr__(name: str) -> Any:
    # Torch-backed parts load on first use so that planning never imports torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autopipe' has no attribute {name!r}")
