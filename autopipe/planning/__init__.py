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

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe.planning.baseline import compare_plans, profile_devices
    from autopipe.planning.configuration.config_search import SearchOptions, search
    from autopipe.planning.hardware.device_catalog import (
        CatalogDevice,
        catalog_devices,
        find_device,
        load_catalog,
        measured_device,
    )
    from autopipe.planning.hardware.estimates import Efficiency, estimate_profile, fit_efficiency
    from autopipe.planning.mesh.mesh_links import GroupLink, MeshLinks
    from autopipe.planning.model.colocation import colocated_plan
    from autopipe.planning.model.cost_model import optimizer_factor
    from autopipe.planning.model.cut_rules import keep_together
    from autopipe.planning.model.device_specs import DeviceSpec, make_devices
    from autopipe.planning.model.in_place_fit import (
        StageSeconds,
        fit_layer_scales,
        fit_update,
        scaled_profile,
        stage_param_bytes,
        uniform_scales,
    )
    from autopipe.planning.model.mesh import MESH_DIMENSIONS, ZERO_STAGES, Mesh
    from autopipe.planning.model.names import (
        ALL_SCHEDULES,
        CHECKPOINT_MODES,
        FIXED_CHECKPOINT_MODES,
        SCHEDULES,
        SEARCH_CHECKPOINTS,
        STRATEGIES,
        V_SCHEDULES,
    )
    from autopipe.planning.model.overhead_fit import overhead_per_clock, unit_clocks
    from autopipe.planning.model.plan_settings import PlanSettings, build_model
    from autopipe.planning.model.plans import Plan, StagePlan, TiedPlan
    from autopipe.planning.model.quantities import (
        format_bytes,
        format_time,
        parse_bytes,
        parse_rate,
    )
    from autopipe.planning.pipeline_settings import PLAN_FIELDS, PipelineSettings, with_overrides
    from autopipe.planning.planner import CHUNKS_PER_STAGE, default_chunks, evaluate, plan
    from autopipe.planning.runtimes.export_formats import check_export_format
    from autopipe.planning.schedules.interleaving import (
        rank_order,
        rank_stages,
        spared,
        stage_placement,
    )
    from autopipe.planning.schedules.simulation import (
        KINDS,
        checkpointed,
        makespan,
        simulate,
        stage_times,
    )
    from autopipe.planning.split.balance import partition
    from autopipe.planning.split.exact import gpipe_step_time
    from autopipe.planning.split.titan_split import has_titan_shape

__all__ = [
    "ALL_SCHEDULES",
    "CHECKPOINT_MODES",
    "CHUNKS_PER_STAGE",
    "FIXED_CHECKPOINT_MODES",
    "KINDS",
    "MESH_DIMENSIONS",
    "PLAN_FIELDS",
    "SCHEDULES",
    "SEARCH_CHECKPOINTS",
    "STRATEGIES",
    "V_SCHEDULES",
    "ZERO_STAGES",
    "CatalogDevice",
    "DeviceSpec",
    "Efficiency",
    "GroupLink",
    "Mesh",
    "MeshLinks",
    "PipelineSettings",
    "Plan",
    "PlanSettings",
    "SearchOptions",
    "StagePlan",
    "StageSeconds",
    "TiedPlan",
    "build_model",
    "catalog_devices",
    "check_export_format",
    "checkpointed",
    "colocated_plan",
    "compare_plans",
    "default_chunks",
    "estimate_profile",
    "evaluate",
    "find_device",
    "fit_efficiency",
    "fit_layer_scales",
    "fit_update",
    "format_bytes",
    "format_time",
    "gpipe_step_time",
    "has_titan_shape",
    "keep_together",
    "load_catalog",
    "make_devices",
    "makespan",
    "measured_device",
    "optimizer_factor",
    "overhead_per_clock",
    "parse_bytes",
    "parse_rate",
    "partition",
    "plan",
    "profile_devices",
    "rank_order",
    "rank_stages",
    "scaled_profile",
    "search",
    "simulate",
    "spared",
    "stage_param_bytes",
    "stage_placement",
    "stage_times",
    "uniform_scales",
    "unit_clocks",
    "with_overrides",
]

_HOMES = {
    "ALL_SCHEDULES": "autopipe.planning.model.names",
    "CHECKPOINT_MODES": "autopipe.planning.model.names",
    "CHUNKS_PER_STAGE": "autopipe.planning.planner",
    "FIXED_CHECKPOINT_MODES": "autopipe.planning.model.names",
    "KINDS": "autopipe.planning.schedules.simulation",
    "MESH_DIMENSIONS": "autopipe.planning.model.mesh",
    "PLAN_FIELDS": "autopipe.planning.pipeline_settings",
    "SCHEDULES": "autopipe.planning.model.names",
    "V_SCHEDULES": "autopipe.planning.model.names",
    "SEARCH_CHECKPOINTS": "autopipe.planning.model.names",
    "STRATEGIES": "autopipe.planning.model.names",
    "ZERO_STAGES": "autopipe.planning.model.mesh",
    "CatalogDevice": "autopipe.planning.hardware.device_catalog",
    "DeviceSpec": "autopipe.planning.model.device_specs",
    "Efficiency": "autopipe.planning.hardware.estimates",
    "GroupLink": "autopipe.planning.mesh.mesh_links",
    "Mesh": "autopipe.planning.model.mesh",
    "MeshLinks": "autopipe.planning.mesh.mesh_links",
    "PipelineSettings": "autopipe.planning.pipeline_settings",
    "Plan": "autopipe.planning.model.plans",
    "PlanSettings": "autopipe.planning.model.plan_settings",
    "SearchOptions": "autopipe.planning.configuration.config_search",
    "StagePlan": "autopipe.planning.model.plans",
    "StageSeconds": "autopipe.planning.model.in_place_fit",
    "TiedPlan": "autopipe.planning.model.plans",
    "build_model": "autopipe.planning.model.plan_settings",
    "catalog_devices": "autopipe.planning.hardware.device_catalog",
    "check_export_format": "autopipe.planning.runtimes.export_formats",
    "checkpointed": "autopipe.planning.schedules.simulation",
    "colocated_plan": "autopipe.planning.model.colocation",
    "compare_plans": "autopipe.planning.baseline",
    "default_chunks": "autopipe.planning.planner",
    "estimate_profile": "autopipe.planning.hardware.estimates",
    "evaluate": "autopipe.planning.planner",
    "find_device": "autopipe.planning.hardware.device_catalog",
    "fit_efficiency": "autopipe.planning.hardware.estimates",
    "fit_layer_scales": "autopipe.planning.model.in_place_fit",
    "fit_update": "autopipe.planning.model.in_place_fit",
    "format_bytes": "autopipe.planning.model.quantities",
    "format_time": "autopipe.planning.model.quantities",
    "gpipe_step_time": "autopipe.planning.split.exact",
    "has_titan_shape": "autopipe.planning.split.titan_split",
    "keep_together": "autopipe.planning.model.cut_rules",
    "load_catalog": "autopipe.planning.hardware.device_catalog",
    "make_devices": "autopipe.planning.model.device_specs",
    "makespan": "autopipe.planning.schedules.simulation",
    "measured_device": "autopipe.planning.hardware.device_catalog",
    "optimizer_factor": "autopipe.planning.model.cost_model",
    "overhead_per_clock": "autopipe.planning.model.overhead_fit",
    "parse_bytes": "autopipe.planning.model.quantities",
    "parse_rate": "autopipe.planning.model.quantities",
    "partition": "autopipe.planning.split.balance",
    "plan": "autopipe.planning.planner",
    "profile_devices": "autopipe.planning.baseline",
    "rank_order": "autopipe.planning.schedules.interleaving",
    "rank_stages": "autopipe.planning.schedules.interleaving",
    "stage_placement": "autopipe.planning.schedules.interleaving",
    "scaled_profile": "autopipe.planning.model.in_place_fit",
    "search": "autopipe.planning.configuration.config_search",
    "simulate": "autopipe.planning.schedules.simulation",
    "spared": "autopipe.planning.schedules.interleaving",
    "stage_param_bytes": "autopipe.planning.model.in_place_fit",
    "stage_times": "autopipe.planning.schedules.simulation",
    "uniform_scales": "autopipe.planning.model.in_place_fit",
    "unit_clocks": "autopipe.planning.model.overhead_fit",
    "with_overrides": "autopipe.planning.pipeline_settings",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
