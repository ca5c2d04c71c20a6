"""``autopipe plan --search --shard-optimizer`` and the mixed-precision optimizer names."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.planning.model.plans import Plan
from tests.support.cli_support import assert_error, run
from tests.support.planning_cases import linear_profile


@pytest.fixture
def one_layer(tmp_path: Path) -> Path:
    """A profile of one layer with 1000 parameter bytes: with Adam 4000 bytes unsharded,
    3000 sharded over 2 replicas."""
    path = tmp_path / "one_layer.json"
    linear_profile([1.0], params=[1000], batch=8).save(path)
    return path


def _search(profile: Path, *extra: str) -> list[str]:
    return ["plan", "--profile", str(profile), "--search", "--devices", "2", *extra]


def test_shard_optimizer_makes_a_search_fit(
    capsys: pytest.CaptureFixture[str], one_layer: Path, tmp_path: Path
) -> None:
    assert_error(*run(capsys, *_search(one_layer, "--memory", "3500")), "no configuration")
    out_file = tmp_path / "best.json"
    argv = _search(one_layer, "--memory", "3500", "--shard-optimizer", "--json", str(out_file))
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "optimizer state sharded over 2 replicas (ZeRO-1): unsharded it does not fit" in out
    assert "optimizer adam (optimizer state sharded over 2 replicas, ZeRO-1)" in out
    best = Plan.load(out_file)
    assert best.shard_optimizer and best.data_parallel == 2
    assert best.stages[0].param_memory == 3000


def test_mixed_precision_optimizer(capsys: pytest.CaptureFixture[str], one_layer: Path) -> None:
    # adam-mixed: 8 bytes per parameter byte unsharded, 2 + 6/2 = 5 sharded over 2.
    argv = _search(one_layer, "--memory", "5500", "--optimizer", "adam-mixed")
    assert_error(*run(capsys, *argv), "no configuration")
    code, out, err = run(capsys, *argv, "--shard-optimizer")
    assert code == 0, err
    assert "optimizer adam-mixed (optimizer state sharded over 2 replicas, ZeRO-1)" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--stages", "1", "--shard-optimizer"], "--shard-optimizer goes with --search"),
        (["--search", "--optimizer", "adam-mix"], "unknown optimizer 'adam-mix'"),
    ],
)
def test_bad_input(
    capsys: pytest.CaptureFixture[str], one_layer: Path, argv: list[str], expected: str
) -> None:
    assert_error(*run(capsys, "plan", "--profile", str(one_layer), *argv), expected)


def test_the_flag_takes_no_value(capsys: pytest.CaptureFixture[str], one_layer: Path) -> None:
    code, out, err = run(capsys, *_search(one_layer, "--shard-optimizer=yes"))
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("autopipe plan: error: argument --shard-optimizer: ignored explicit")
