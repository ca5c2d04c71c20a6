"""The split solvers: the exact min-max split, its screening and intervals, the peers' heuristics.

Above :mod:`autopipe.planning.model`, whose cost model they evaluate; below the planner,
which picks the solver for a plan."""

from __future__ import annotations

__all__: list[str] = []
