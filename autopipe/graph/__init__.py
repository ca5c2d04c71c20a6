"""Graph: any ``nn.Module`` traced (torch.fx or torch.export) and cut into units."""

from __future__ import annotations

from autopipe.errors import TracingError
from autopipe.graph.flat_io import FlatSpec
from autopipe.graph.layout import Layout, layout_model, stage_of_units
from autopipe.graph.sequential import ModelIO, SequentialModel, prepare, unit_sequential
from autopipe.graph.shapes import DynamicSpec
from autopipe.graph.stage_modules import UnitModule, UnitSequential
from autopipe.graph.tracing import METHODS, Traced, trace
from autopipe.graph.units import GRANULARITIES

__all__ = [
    "GRANULARITIES",
    "METHODS",
    "DynamicSpec",
    "FlatSpec",
    "Layout",
    "ModelIO",
    "SequentialModel",
    "Traced",
    "TracingError",
    "UnitModule",
    "UnitSequential",
    "layout_model",
    "prepare",
    "stage_of_units",
    "trace",
    "unit_sequential",
]
