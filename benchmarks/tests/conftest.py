"""The benchmarks' tests run with the same settings as the others (an empty calibration
cache of their own) and take the peers' functions as the planner's tests do."""

from __future__ import annotations

from tests.conftest import _session_cache, calibration_cache
from tests.support.peer_references import deepspeed_utils, solve, titan

__all__ = ["_session_cache", "calibration_cache", "deepspeed_utils", "solve", "titan"]
