"""Per-layer measurement of PyTorch models for pipeline planning.

The data model (:class:`Profile`) imports no torch; the measuring functions load torch
only when first used, so the planner stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from profiler.fit import fit_linear
from profiler.profile import PROFILE_VERSION, LayerProfile, Profile, TiedState

if TYPE_CHECKING:
    from profiler.measure import profile_layers, profile_model

__all__ = [
    "PROFILE_VERSION",
    "LayerProfile",
    "Profile",
    "TiedState",
    "fit_linear",
    "profile_layers",
    "profile_model",
]


def __getattr__(name: str) -> Any:
    if name in ("profile_layers", "profile_model"):
        from profiler import measure

        return getattr(measure, name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
