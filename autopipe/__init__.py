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
from profiler.profile import LayerProfile, Profile

if TYPE_CHECKING:
    from autopipe.gpipe import GPipe

__version__ = "0.1.0"

__all__ = [
    "DeviceSpec",
    "GPipe",
    "LayerProfile",
    "Plan",
    "PlanningError",
    "Profile",
    "StagePlan",
    "make_devices",
    "partition",
    "plan",
]

_LAZY = {"GPipe": "autopipe.gpipe"}


def __getattr__(name: str) -> Any:
    # Torch-backed parts load on first use so that planning never imports torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autopipe' has no attribute {name!r}")
