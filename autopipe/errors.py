"""Errors the planner raises for inputs it cannot plan."""

from __future__ import annotations

__all__ = ["PlanningError"]


class PlanningError(ValueError):
    """No split satisfies the request; the message says what is missing and where."""
