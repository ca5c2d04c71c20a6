"""The mesh around the pipeline: per-device figures under tensor, context, expert and
sharded data parallelism.

Above :mod:`autopipe.planning.model` (it turns a profile's lines into the lines one device
of a stage's tensor × context group sees, which the cost model then reads unchanged);
beside the split solvers; below the planner and the search."""

from __future__ import annotations

__all__: list[str] = []
