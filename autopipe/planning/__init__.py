"""Planning: pure numbers, no torch — cost model, split solvers, schedules, search, reports."""

from __future__ import annotations

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
