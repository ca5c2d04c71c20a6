"""The benchmarks' tests run with the same settings as the others (an empty calibration
cache of their own)."""

from __future__ import annotations

from tests.conftest import _session_cache, calibration_cache

__all__ = ["_session_cache", "calibration_cache"]
