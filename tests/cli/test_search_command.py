"""Tests of ``autopipe plan --search`` (autopipe.cli.search_command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.planning.model.plans import Plan
from tests.support.cli_support import assert_error, run


def test_search(capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "best.json"
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "4", "--top", "3"]
    code, out, err = run(capsys, *argv, "--allreduce-bandwidth", "1GB", "--json", str(out_file))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["#", "K", "D", "M", "checkpoint", "schedule"]
    assert lines[1].startswith("1 ") and lines[1].endswith("best")
    assert "the best plan:" in out and "balance" in out
    best = Plan.load(out_file)
    assert best.num_devices <= 4 and best.throughput > 0
    assert f"{best.num_stages} stage{'' if best.num_stages == 1 else 's'}" in out
    assert "plan written to" in err


def test_search_restricted_to_a_mode(
    capsys: pytest.CaptureFixture[str], profile_file: Path
) -> None:
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "2"]
    code, out, err = run(capsys, *argv, "--checkpoint", "never", "--schedule", "1f1b")
    assert code == 0, err
    rows = out.split("\n\n")[0].splitlines()[1:]
    assert rows and all(" never " in row and " 1f1b " in row for row in rows if row[0].isdigit())


def test_search_at_given_pipeline_depths(
    capsys: pytest.CaptureFixture[str], profile_file: Path
) -> None:
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "4", "--top", "50"]
    code, out, err = run(capsys, *argv, "--pipeline-parallel", "2")
    assert code == 0, err
    rows = [row.split() for row in out.split("\n\n")[0].splitlines()[1:] if row[:1].isdigit()]
    assert rows and all(row[1] == "2" for row in rows)  # the K column


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--pipeline-parallel", "5"], "no configuration of 2 devices has a pipeline of 5"),
        (["--stages", "2"], "--search chooses the stages itself"),
        (["--memory", "1GB,2GB"], "--search needs one --memory size"),
        (["--memory", "1KB"], "no configuration of up to 2 devices fits"),
        (["--strategy", "uniform"], "--search plans with the optimal strategy"),
    ],
)
def test_bad_search_options(
    capsys: pytest.CaptureFixture[str], profile_file: Path, args: list[str], expected: str
) -> None:
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "2", *args]
    assert_error(*run(capsys, *argv), expected)


def test_search_on_one_device(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "best.json"
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "3", "--top", "1000"]
    code, out, err = run(capsys, *argv, "--one-device", "--json", str(out_file))
    assert code == 0, err
    rows = [row.split() for row in out.split("\n\n")[0].splitlines()[1:] if row[:1].isdigit()]
    assert rows and {row[2] for row in rows} == {"1"}  # D: one replica
    assert all("gpipe" in row for row in rows)
    assert {row[1] for row in rows} == {"1", "2", "3"}  # K: up to --devices stages
    assert "taking turns on one cpu" in out
    best = Plan.load(out_file)
    assert best.num_devices == 1
    if best.num_stages > 1:
        assert best.shared == [list(range(best.num_stages))]
        assert "share cpu: they run one after another" in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--schedule", "1f1b"], "search the schedule gpipe"),
        (["--virtual-stages", "2"], "leave out virtual_stages (--virtual-stages)"),
        (["--shard-optimizer"], "no copies to shard the optimizer state over"),
        (["--allreduce-bandwidth", "1GB"], "leave out --target and --allreduce-bandwidth"),
        (["--memory", "1KB"], "no configuration of up to 2 stages on one device fits"),
    ],
)
def test_bad_one_device_search_options(
    capsys: pytest.CaptureFixture[str], profile_file: Path, args: list[str], expected: str
) -> None:
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "2", "--one-device"]
    assert_error(*run(capsys, *argv, *args), expected)


def _mesh_profile(tmp_path: Path, shards: bool = True) -> Path:
    from tests.support.mesh_profiles import block_profile, roofline_record

    path = tmp_path / "blocks.json"
    profile = block_profile(8, batch=16, estimate=roofline_record(), shards=shards)
    profile.save(path)
    return path


def test_search_a_mesh(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "best.json"
    argv = ["plan", "--profile", str(_mesh_profile(tmp_path)), "--search", "--devices", "8"]
    mesh = ["--tensor-parallel", "1,2,4", "--context-parallel", "1,2", "--sequence-parallel"]
    mesh += ["--zero", "0,1,2,3", "--global-batch", "16", "--micro-batch", "1"]
    mesh += ["--sequence", "4", "--allreduce-bandwidth", "64", "--top", "4"]
    code, out, err = run(capsys, *argv, *mesh, "--json", str(out_file))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["#", "mesh", "M"] and "MFU" in lines[0]
    assert any(line.startswith("- chosen mesh: TP=") for line in lines)
    best = Plan.load(out_file)
    assert best.num_devices == 8 and best.sequence == 4
    assert best.chunks * best.data_parallel * best.micro_batch == 16


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tensor-parallel", "3"], "has 8 attention heads, which tensor parallelism 3"),
        (["--zero", "1", "--shard-optimizer"], "leave out --shard-optimizer"),
        (["--micro-batch", "3"], "no mesh of 8 devices matches the batch 16"),
        (
            ["--sequence-parallel", "--tensor-parallel", "1"],
            "sequence parallelism goes with a tensor-parallel degree",
        ),
        (["--global-batch", "8", "--batch", "16", "--micro-batch", "1"], "give one of them"),
    ],
)
def test_bad_mesh_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], expected: str
) -> None:
    argv = ["plan", "--profile", str(_mesh_profile(tmp_path)), "--search", "--devices", "8"]
    assert_error(*run(capsys, *argv, *args), expected)


def test_a_profile_without_shard_counts_is_told_how_to_count_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _mesh_profile(tmp_path, shards=False)
    argv = ["plan", "--profile", str(path), "--search", "--devices", "8", "--tensor-parallel", "2"]
    assert_error(*run(capsys, *argv), "has no shard counts")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tensor-parallel", "two"], "argument --tensor-parallel: expected positive integers"),
        (["--zero", "4"], "argument --zero: expected ZeRO stages among 0,1,2,3"),
    ],
)
def test_mesh_options_that_do_not_parse(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], expected: str
) -> None:
    argv = ["plan", "--profile", str(_mesh_profile(tmp_path)), "--search", "--devices", "8"]
    code, out, err = run(capsys, *argv, *args)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("autopipe plan: error: ") and expected in err


def test_a_profile_counted_with_a_tp_plan_weighs_tensor_parallelism_unasked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["plan", "--profile", str(_mesh_profile(tmp_path)), "--search", "--devices", "8"]
    code, out, err = run(capsys, *argv, "--top", "40")
    assert code == 0, err
    assert any(f"TP={t} " in out for t in (2, 4, 8)), out
