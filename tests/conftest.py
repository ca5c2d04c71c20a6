"""Settings every test runs under: caches (profiles, calibration) of its own, never the
user's, so that none reads what another test wrote."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The shared helpers check with plain asserts: rewrite them as in test modules, so that a
# failure shows the values compared.
pytest.register_assert_rewrite("tests.support")


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The calibration cache of runs started for many tests: empty, never the user's."""
    before = os.environ.get("AUTOPIPE_CACHE_DIR")
    os.environ["AUTOPIPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("AUTOPIPE_CACHE_DIR", None)
    else:
        os.environ["AUTOPIPE_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def calibration_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own empty calibration cache, so what one measures no other plans with."""
    folder = tmp_path / "autopipe-cache"
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(folder))
    return folder / "calibration.json"


@pytest.fixture
def float64() -> Iterator[None]:
    """float64 as the default dtype for the test, so that results are exact to rounding."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
