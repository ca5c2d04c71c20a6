"""The errors autopipe raises for a request it cannot carry out, one class per cause."""

from __future__ import annotations

__all__ = ["ModelFileError", "PlanningError", "TracingError"]


class PlanningError(ValueError):
    """No split satisfies the request; the message says what is missing and where."""


class TracingError(RuntimeError):
    """The model could be traced neither by torch.fx nor by torch.export."""


class ModelFileError(ValueError):
    """A model file cannot be used; the one-line message says what to fix."""
