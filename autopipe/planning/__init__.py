"""Planning: pure numbers, no torch — cost model, split solvers, schedules, search, reports."""

from __future__ import annotations

from autopipe.planning.balance import partition
from autopipe.planning.catalog import CatalogDevice, find_device, load_catalog
from autopipe.planning.config_search import search
from autopipe.planning.devices import DeviceSpec, make_devices
from autopipe.planning.estimates import estimate_profile, fit_efficiency
from autopipe.planning.interleaving import rank_order
from autopipe.planning.planner import plan
from autopipe.planning.plans import Plan, StagePlan
from autopipe.planning.simulation import simulate

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
