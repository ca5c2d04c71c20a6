"""The cost model and what it reads: devices, bytes and seconds, layer costs, plans.

Above :mod:`autopipe.planning.schedules` (the cost model counts the micro-batches each
schedule holds in flight) and :mod:`autopipe.planning.runtimes` (``Plan.export`` loads a
format when called); below the split solvers, which evaluate it. The modules are reached
through :mod:`autopipe.planning` or by their own paths inside planning."""

from __future__ import annotations

__all__: list[str] = []
