"""The configuration search: every K×D, micro-batch count, schedule and checkpoint mode.

On top of planning: the search runs the planner for each candidate. (Named
``configuration``: a subpackage ``search`` would be hidden by the function
``autopipe.planning.search``.)"""

from __future__ import annotations

__all__: list[str] = []
