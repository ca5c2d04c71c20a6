"""Fixtures of the command-line tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli_support import make_profile_file


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/mlp.py profiled quickly, once per test module."""
    return make_profile_file(tmp_path_factory)
