"""Graph: any ``nn.Module`` traced (torch.fx or torch.export) and cut into units.

Each name below loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe import TracingError
    from autopipe.graph.batch_outputs import per_micro_batch_note
    from autopipe.graph.flat_io import FlatSpec
    from autopipe.graph.layout import Layout, layout_model, stage_of_units
    from autopipe.graph.meta import (
        has_meta_state,
        materialize_units,
        meta_bytes,
        rebind_state,
        unused_meta,
    )
    from autopipe.graph.sequential import (
        ModelIO,
        SequentialModel,
        model_inputs,
        prepare,
        unit_sequential,
    )
    from autopipe.graph.shapes import DynamicSpec
    from autopipe.graph.sharing import check_placement, copied_written, graph_writes
    from autopipe.graph.stage_modules import UnitModule, UnitSequential
    from autopipe.graph.tp_plan import (
        check_tp_plan,
        model_tp_plan,
        module_styles,
        read_tp_plan,
        shard_styles,
    )
    from autopipe.graph.tracing import METHODS, PREFIX, Traced, trace
    from autopipe.graph.units import GRANULARITIES

__all__ = [
    "GRANULARITIES",
    "METHODS",
    "PREFIX",
    "DynamicSpec",
    "FlatSpec",
    "Layout",
    "ModelIO",
    "SequentialModel",
    "Traced",
    "TracingError",
    "UnitModule",
    "UnitSequential",
    "check_placement",
    "check_tp_plan",
    "copied_written",
    "graph_writes",
    "has_meta_state",
    "layout_model",
    "materialize_units",
    "meta_bytes",
    "model_inputs",
    "model_tp_plan",
    "module_styles",
    "per_micro_batch_note",
    "prepare",
    "read_tp_plan",
    "rebind_state",
    "shard_styles",
    "stage_of_units",
    "trace",
    "unit_sequential",
    "unused_meta",
]

_HOMES = {
    "GRANULARITIES": "autopipe.graph.units",
    "METHODS": "autopipe.graph.tracing",
    "PREFIX": "autopipe.graph.tracing",
    "DynamicSpec": "autopipe.graph.shapes",
    "FlatSpec": "autopipe.graph.flat_io",
    "Layout": "autopipe.graph.layout",
    "ModelIO": "autopipe.graph.sequential",
    "SequentialModel": "autopipe.graph.sequential",
    "Traced": "autopipe.graph.tracing",
    "TracingError": "autopipe",
    "UnitModule": "autopipe.graph.stage_modules",
    "UnitSequential": "autopipe.graph.stage_modules",
    "check_placement": "autopipe.graph.sharing",
    "check_tp_plan": "autopipe.graph.tp_plan",
    "copied_written": "autopipe.graph.sharing",
    "graph_writes": "autopipe.graph.sharing",
    "has_meta_state": "autopipe.graph.meta",
    "layout_model": "autopipe.graph.layout",
    "materialize_units": "autopipe.graph.meta",
    "meta_bytes": "autopipe.graph.meta",
    "model_inputs": "autopipe.graph.sequential",
    "model_tp_plan": "autopipe.graph.tp_plan",
    "module_styles": "autopipe.graph.tp_plan",
    "per_micro_batch_note": "autopipe.graph.batch_outputs",
    "prepare": "autopipe.graph.sequential",
    "read_tp_plan": "autopipe.graph.tp_plan",
    "rebind_state": "autopipe.graph.meta",
    "shard_styles": "autopipe.graph.tp_plan",
    "stage_of_units": "autopipe.graph.layout",
    "trace": "autopipe.graph.tracing",
    "unit_sequential": "autopipe.graph.sequential",
    "unused_meta": "autopipe.graph.meta",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
