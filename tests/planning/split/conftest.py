"""The peers' own functions, for the tests that check each peer strategy against them."""

from __future__ import annotations

from tests.support.peer_references import deepspeed_utils, solve, titan

__all__ = ["deepspeed_utils", "solve", "titan"]
