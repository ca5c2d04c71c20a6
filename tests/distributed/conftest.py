"""The multi-rank run that the tests of several modules read, started once for them all."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.dist_workers import scenario_results


@pytest.fixture(scope="package", params=[2, 4], ids=["2ranks", "4ranks"])
def equal_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The "equal" scenario on 2 and on 4 ranks: ``(world, results)``, one per rank."""
    world = request.param
    workdir = tmp_path_factory.mktemp(f"equal{world}")
    return world, scenario_results("equal", world, workdir, limit=80)
