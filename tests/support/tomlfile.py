"""Reading the TOML the exports write."""

from __future__ import annotations

from typing import Any

import pytest


def read_toml(text: str) -> dict[str, Any]:
    """The TOML reader of the standard library (Python 3.11 on); skips the test before."""
    return pytest.importorskip("tomllib").loads(text)
