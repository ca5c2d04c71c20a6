"""Planning: pure numbers, no torch — the cost model, split solvers, schedules and search.

Its subpackages are layered, each importing only those below it (``.importlinter`` checks
it): :mod:`~autopipe.planning.schedules` (rank orders and the replay of a step: they depend
on K, v and M only) and :mod:`~autopipe.planning.runtimes` (a plan's split for other
runtimes, which :meth:`Plan.export` loads when called) at the bottom;
:mod:`~autopipe.planning.model` (devices, quantities, the cost model, plans) above them;
:mod:`~autopipe.planning.split` (the split solvers, which read the cost model);
:mod:`~autopipe.planning.planner` (``plan``: a cost model solved into a plan); and on top,
independent of each other, :mod:`~autopipe.planning.configuration` (the configuration
search, which runs the planner many times) and :mod:`~autopipe.planning.hardware` (the
device catalog and the profiles estimated from it).

Every name below loads its module on first use, so a plain ``plan`` loads neither the
search, nor the catalog, nor the estimates.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopipe.planning.configuration.config_search import search
    from autopipe.planning.hardware.device_catalog import CatalogDevice, find_device, load_catalog
    from autopipe.planning.hardware.estimates import estimate_profile, fit_efficiency
    from autopipe.planning.model.device_specs import DeviceSpec, make_devices
    from autopipe.planning.model.plans import Plan, StagePlan
    from autopipe.planning.planner import plan
    from autopipe.planning.schedules.interleaving import rank_order
    from autopipe.planning.schedules.simulation import simulate
    from autopipe.planning.split.balance import partition

__all__ = [
    "CatalogDevice",
    "DeviceSpec",
    "Plan",
    "StagePlan",
    "estimate_profile",
    "find_device",
    "fit_efficiency",
    "load_catalog",
    "make_devices",
    "partition",
    "plan",
    "rank_order",
    "search",
    "simulate",
]

_HOMES = {
    "CatalogDevice": "autopipe.planning.hardware.device_catalog",
    "DeviceSpec": "autopipe.planning.model.device_specs",
    "Plan": "autopipe.planning.model.plans",
    "StagePlan": "autopipe.planning.model.plans",
    "estimate_profile": "autopipe.planning.hardware.estimates",
    "find_device": "autopipe.planning.hardware.device_catalog",
    "fit_efficiency": "autopipe.planning.hardware.estimates",
    "load_catalog": "autopipe.planning.hardware.device_catalog",
    "make_devices": "autopipe.planning.model.device_specs",
    "partition": "autopipe.planning.split.balance",
    "plan": "autopipe.planning.planner",
    "rank_order": "autopipe.planning.schedules.interleaving",
    "search": "autopipe.planning.configuration.config_search",
    "simulate": "autopipe.planning.schedules.simulation",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'autopipe.planning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
