"""ZBV and DualPipeV on 2 and 4 gloo ranks train as the plain model does (float64, SGD)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist_workers import scenario_results
from tests.support.v_workers import V_STEPS, reference

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def v_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    workdir = tmp_path_factory.mktemp(f"v{world}")
    return world, workdir, scenario_results("v", world, workdir, limit=150 * world)


def _close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_v_schedule_trains_as_the_plain_model(v_run: Any, kind: str, schedule: str) -> None:
    world, _, results = v_run
    chunks = 2 * world
    expected = reference(kind, 2 * chunks, chunks)
    for rank, result in enumerate(results):
        run = result[kind, schedule]
        assert run["stages"] == [rank, 2 * world - 1 - rank]
        assert len(run["balance"]) == 2 * world
        assert run["first_last"] == (rank == 0, rank == 0)  # rank 0 reads inputs and targets
        for step in range(V_STEPS):
            got, want = run["steps"][step], expected[step]
            if rank == 0:
                _close(got["loss"], want["loss"], f"loss {step}")
            else:
                assert got["loss"] is None
            for name, value in got["params"].items():
                _close(value, want["params"][name], f"{name} after step {step}")
    held = {name for result in results for name in result[kind, schedule]["steps"][-1]["params"]}
    assert held == set(expected[-1]["params"])
    gathered = results[0][kind, schedule]["state"]
    plain = expected[-1]["params"]
    for name, value in plain.items():
        _close(gathered[name], value, name)
    assert all(result[kind, schedule]["state"] is None for result in results[1:])


def test_v_step_trace_is_written(v_run: Any) -> None:
    _, workdir, _ = v_run
    assert (Path(workdir) / "trace.json").stat().st_size > 0


def test_v_refusals_and_given_balance(v_run: Any) -> None:
    world, _, results = v_run
    k2 = 2 * world
    for result in results:
        errors = result["errors"]
        assert f"use chunks >= {k2}" in errors["chunks"]
        assert f"balance has 2 entries; give {k2}" in errors["balance"]
        assert "splits each backward" in errors["checkpoint"]
        assert "balance= splits the stages of a V schedule" in errors["not v"]
        assert result["given"] == [16 - (k2 - 1)] + [1] * (k2 - 1)
