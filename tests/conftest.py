"""Every test gets a profile cache of its own, so that none reads another's or the user's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """For fixtures wider than a test (a profile made once per module)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True)
def _test_cache(_session_cache: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path / "autopipe-cache"))
