"""Graph: any ``nn.Module`` traced (torch.fx or torch.export) and cut into units."""

from __future__ import annotations

from autopipe.graph.tracing import Traced, TracingError, trace

__all__ = ["Traced", "TracingError", "trace"]
