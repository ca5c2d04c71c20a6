"""Virtual stages: K·v stages on K ranks, checked and equal to one process."""

from __future__ import annotations

from typing import Any

import pytest

from autopipe.distributed.setup import check_sizes
from autopipe.distributed.virtual import stage_indices, virtual_problem
from tests.support.dist_models import assert_close, reference_steps, tiny_plan
from tests.support.dist_workers import scenario_results


def test_virtual_stage_checks() -> None:
    check_sizes(2, 8, tiny_plan(stages=4), "1f1b", 4, virtual_stages=2)
    check_sizes(2, 8, None, "1f1b", 1, virtual_stages=2)  # one round: any chunks fit
    with pytest.raises(ValueError, match="plan has 2 stages but virtual_stages=2"):
        check_sizes(2, 8, tiny_plan(), "1f1b", 4, virtual_stages=2)
    with pytest.raises(ValueError, match="cannot split 8 layers into 12 stages"):
        check_sizes(4, 8, None, "gpipe", 4, virtual_stages=3)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        check_sizes(2, 8, None, "1f1b", 5, virtual_stages=2)
    check_sizes(2, 8, None, "gpipe", 5, virtual_stages=2)  # looped BFS takes any chunks
    assert stage_indices(1, 3, 2) == [1, 4]
    assert virtual_problem(0) is not None and virtual_problem(2) is None


@pytest.fixture(scope="module")
def virtual_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("virtual")
    return scenario_results("virtual", 2, workdir, limit=60)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_virtual_stages_equal_one_process(virtual_run: list[dict[str, Any]], schedule: str) -> None:
    loss, once, twice, state = reference_steps()
    seen: set[str] = set()
    for rank, result in enumerate(virtual_run):
        run = result[schedule]
        indices, first, last, text = run["layout"]
        assert indices == [rank, rank + 2] and (first, last) == (rank == 0, rank == 1)
        assert f"stage {rank}/2, virtual_stages=2 [{rank}, {rank + 2}]" in text
        assert len(run["balance"]) == 4  # the plan balances K·v stages
        virtual, predicted, replayed = run["plan"]  # and predicts the interleaved schedule
        assert virtual == 2 and predicted == pytest.approx(replayed)
        if rank == 1:  # holds the last stage, 3
            assert_close(run["loss"], loss)
        else:
            assert run["loss"] is None
        for name, grad in run["grads"].items():
            assert_close(grad, once[name], name)
            assert_close(run["twice"][name], twice[name], name)
            seen.add(name)
        own = sum(once[name].numel() for name in run["grads"])
        assert run["optimized"] == own  # module.parameters() holds both stages' parameters
    assert seen == set(once)
    gathered = virtual_run[0][schedule]["state"]
    assert list(gathered) == list(state)
    for key, value in state.items():
        assert_close(gathered[key], value, key)
    assert virtual_run[1][schedule]["state"] is None


def test_virtual_stage_mismatches_are_reported_on_every_rank(
    virtual_run: list[dict[str, Any]],
) -> None:
    for result in virtual_run:
        errors = result["errors"]
        assert "plan has 2 stages but virtual_stages=2 on 2 ranks" in errors["stages"]
        assert "K·v = 4" in errors["stages"]
        assert "chunks=5" in errors["chunks"] and "rounds" in errors["chunks"]
        assert "virtual_stages differs between rank 0 and rank 1" in errors["ranks"]
        assert "plan was made for virtual_stages=4 but the pipeline runs" in errors["planned"]
