"""Schedules: the order each rank runs its operations in, the step replayed, simulated.

The bottom of planning: an order depends only on the schedule, K, v and M, never on costs
or plans, so the cost model above can count what a schedule holds in flight. The
simulation names a ``Plan`` in annotations only."""

from __future__ import annotations

__all__: list[str] = []
