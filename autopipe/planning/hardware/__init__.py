"""Devices one does not have: the bundled catalog and profiles estimated from its peaks.

On top of planning beside :mod:`autopipe.planning.configuration` and independent of it:
it reads only devices and quantities, and a plain ``plan`` never loads it."""

from __future__ import annotations

__all__: list[str] = []
