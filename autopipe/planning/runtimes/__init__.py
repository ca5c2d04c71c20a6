"""A plan's split for other runtimes: torch, torchtitan, Megatron-LM, DeepSpeed.

At the bottom of planning: ``Plan.export`` imports a format when called, and the formats
name ``Plan`` in annotations only, so neither module imports the other when loaded."""

from __future__ import annotations

__all__: list[str] = []
