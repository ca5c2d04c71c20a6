"""Tests of ``autopipe bench`` (autopipe.cli.bench_command)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.planning.model.names import STRATEGIES
from tests.support.cli_support import RESIDUAL_MODEL, SMALL_MODEL, assert_error, run

# The strategies the default --strategies runs on a model that is no decoder-only
# transformer: all but torchtitan.
APPLICABLE = tuple(name for name in STRATEGIES if name != "torchtitan")

# Profiling once per layer, quickly: the tests check what is reported, not how fast.
QUICK = ["--profile-repeats", "1", "--profile-warmup", "0", "--chunks", "2"]


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "small.py"
    path.write_text(SMALL_MODEL)  # Linear, ReLU, Linear: three units
    return str(path)


def test_bench_one_process(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_file: str
) -> None:
    out_json, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    code, out, err = run(
        capsys,
        "bench",
        model_file,
        "--stages",
        "2",
        *QUICK,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--balance",
        "1,2",
        "--json",
        str(out_json),
        "--picture",
        str(picture),
    )
    assert code == 0, err
    rows: dict[str, str] = {}
    for line in out.splitlines():  # the first table: one row per split
        if line.split():
            rows.setdefault(line.split()[0], line)
    for label in (*APPLICABLE, "given"):
        assert label in rows
    assert "torchtitan" not in rows
    assert "[1, 2]" in rows["given"]
    assert "loss: mean of the output" in out and "GPipe in one process on cpu" in out
    assert "speed-up of the row over the column" in out
    assert "profiled in this process with" in out and "calibrated" not in out
    # One warm-up step only sets things up: nothing to time in place.
    assert "predicted from the profile: --warmup 2 or more times the splits in place" in out
    # Progress on stderr: one line a round, warm-up included.
    assert "round 3/3 done" in err
    assert picture.read_bytes().startswith(b"\x89PNG")

    record = json.loads(out_json.read_text())
    settings = record["settings"]
    assert settings["stages"] == 2 and settings["chunks"] == 2
    assert settings["runner"] == "gpipe" and settings["steps"] == 2 and settings["warmup"] == 1
    splits = {split["label"]: split for split in record["splits"]}
    assert set(splits) == {*APPLICABLE, "given"}
    given = splits["given"]
    assert given["balance"] == [1, 2] and given["steps"] == 2 and len(given["times"]) == 2
    for key in ("measured", "spread", "predicted", "ideal", "stage_times", "saved_peak"):
        assert key in given
    assert given["measured_over_ideal"] == pytest.approx(given["measured"] / given["ideal"])
    # Both stages take turns on the one CPU: the ideal and the prediction are M·Σc.
    assert given["ideal"] == pytest.approx(sum(given["stage_times"]) * 2)
    assert given["predicted"] == pytest.approx(sum(given["stage_times"]) * 2)
    assert "predicted: stages 0, 1 share cpu: they run one after another" in out
    assert len(given["saved_peak"]) == 2 and all(p > 0 for p in given["saved_peak"])
    assert record["speedups"]["given"]["optimal"] == pytest.approx(
        splits["optimal"]["measured"] / given["measured"]
    )
    assert record["plans"]["given"]["balance"] == [1, 2]
    assert "profile" not in record["plans"]["given"]  # saved once by autopipe profile


def test_bench_two_ranks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_file: str, calibration_cache: Path
) -> None:
    out_json = tmp_path / "bench.json"
    code, out, err = run(
        capsys,
        "bench",
        model_file,
        "--ranks",
        "2",
        *QUICK,
        "--strategies",
        "optimal,uniform",
        "--steps",
        "2",
        "--warmup",
        "2",
        "--json",
        str(out_json),
    )
    assert code == 0, err
    assert "2 local ranks" in out
    # The predictions come from the stages timed in the second warm-up step.
    fitted = "predicted from in-place figures: each stage's forward and backward timed"
    assert fitted in out
    assert json.loads(out_json.read_text())["settings"]["in_place"].startswith(fitted)
    record = json.loads(out_json.read_text())
    assert record["settings"]["runner"] == "distributed" and record["settings"]["ranks"] == 2
    assert [split["label"] for split in record["splits"]] == ["optimal", "uniform"]
    for split in record["splits"]:
        assert len(split["times"]) == 2 and len(split["saved_peak"]) == 2
    # Profiled as a rank runs, and calibrated on the ranks, once: the plans count it.
    assert "profiled on the 2 ranks at once, each bound to its CPUs" in out
    assert f"(measured now, kept in {calibration_cache})" in out
    from autopipe.distributed.calibration_cache import cached_runner_calibration

    (entry,) = json.loads(calibration_cache.read_text())["entries"]
    cached = cached_runner_calibration(entry)
    assert cached is not None
    for plan in record["plans"].values():
        assert all(stage["overhead"] == cached["overhead_s"] for stage in plan["stages"])
        # Each stage's prediction is what its stages measured in place, up to the fit.
    assert record["settings"]["warmup"] == 2
    argv = ["bench", model_file, "--ranks", "2", *QUICK, "--strategies", "optimal"]
    code, out, err = run(capsys, *argv, "--steps", "1", "--warmup", "0")
    assert code == 0, err
    assert "calibrated: the runner costs" in out and "(cached from" in out
    code, out, err = run(capsys, *argv, "--steps", "1", "--warmup", "0", "--no-calibrate")
    assert code == 0, err
    assert "not calibrated (--no-calibrate)" in out


def test_bench_one_process_fits_its_warm_up_steps(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_file: str
) -> None:
    out_json = tmp_path / "bench.json"
    argv = ["bench", model_file, "--stages", "2", *QUICK, "--strategies", "optimal,uniform"]
    code, out, err = run(capsys, *argv, "--steps", "1", "--warmup", "2", "--json", str(out_json))
    assert code == 0, err
    assert "predicted from in-place figures: every layer's time x" in out
    assert "fitted on the splits' later warm-up steps" in out
    code, out, err = run(capsys, *argv, "--steps", "1", "--warmup", "2", "--no-calibrate")
    assert code == 0, err
    assert "in-place" not in out and "in-step scale" not in out


def test_bench_traced_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)  # no nn.Sequential: traced and cut into units
    code, out, err = run(
        capsys,
        "bench",
        str(path),
        "--stages",
        "2",
        *QUICK,
        "--strategies",
        "optimal",
        "--steps",
        "1",
        "--warmup",
        "0",
    )
    assert code == 0, err
    lines = out.splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("split "))
    assert lines[table + 1].startswith("optimal")
    assert "1 timed step per split" in out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--stages", "2", "--balance", "1,1"], "sums to 2 but the model has 3 units"),
        (["--stages", "2", "--balance", "1,1,1"], "has 3 stages but --stages is 2"),
        (["--stages", "2", "--balance", "1,x"], "positive unit counts such as 3,5,4"),
        (["--stages", "4"], "cannot split 3 units into 4 non-empty stages"),
        (["--stages", "2", "--memory", "1B"], "does not fit"),
        (
            ["--stages", "2", "--strategies", "", "--balance", "1,2", "--memory", "1B"],
            "the --balance split [1, 2] does not fit",
        ),
        (["--stages", "2", "--strategies", "optimal,fastest"], "unknown strategy 'fastest'"),
        (["--stages", "2", "--strategies", ""], "give at least one strategy or --balance"),
        (["--stages", "2", "--strategies", "torchtitan"], "strategy 'torchtitan' needs a decoder"),
        (["--stages", "3", "--ranks", "2"], "--ranks 2 runs one stage per rank"),
        (["--stages", "2", "--schedule", "1f1b"], "add --ranks K"),
        (["--stages", "2", "--memory", "1GiB,1GiB,1GiB"], "lists 3 sizes but there are 2"),
        (["--stages", "2", "--picture", "bench.txt"], ".png or .svg"),
        # Several stages per rank: what no runner runs is refused before any rank starts.
        (["--stages", "2", "--schedule", "zbv"], "--schedule zbv runs on the distributed"),
        (["--stages", "2", "--virtual-stages", "2"], "--virtual-stages 2 runs on the distrib"),
        (
            ["--ranks", "2", "--schedule", "dualpipev", "--virtual-stages", "2"],
            "places 2 stages on each rank itself (rank r holds stages r and 2K-1-r)",
        ),
        (
            ["--ranks", "2", "--schedule", "zbv", "--checkpoint", "always"],
            "--checkpoint always is not supported",
        ),
        (["--ranks", "2", "--schedule", "zbv"], "needs at least as many micro-batches as its 4"),
        (
            ["--ranks", "2", "--schedule", "1f1b", "--virtual-stages", "2", "--chunks", "5"],
            "interleaved 1f1b runs the micro-batches in rounds",
        ),
        (["--ranks", "2", "--schedule", "zbv", "--stages", "4"], "--stages counts the ranks"),
        (
            ["--ranks", "2", "--schedule", "zbv", "--chunks", "4"],
            "cannot split 3 units into 4 non-empty stages (2 per rank); use --ranks 1",
        ),
    ],
)
def test_bench_bad_input(
    capsys: pytest.CaptureFixture[str], model_file: str, options: list[str], message: str
) -> None:
    code, out, err = run(capsys, "bench", model_file, *QUICK, *options)
    assert_error(code, out, err, message)


def test_bench_zbv_on_two_ranks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Five units, so that the V's four stages (two per rank) each get one.
    path = tmp_path / "five.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), "
        "nn.Linear(8, 2))\nsample = torch.randn(8, 4)\n"
    )
    # Profiled here, quickly: the bench spawns ranks only to calibrate and to step.
    profile = tmp_path / "five.profile.json"
    quick = ["--repeats", "1", "--warmup", "0", "--no-cache", "--chunks", "4"]
    code, _, err = run(capsys, "profile", str(path), "-o", str(profile), *quick)
    assert code == 0, err
    out_json = tmp_path / "bench.json"
    argv = ["bench", str(path), "--profile", str(profile), "--ranks", "2", "--schedule", "zbv"]
    argv += ["--chunks", "4", "--strategies", "optimal", "--steps", "2", "--warmup", "2"]
    code, out, err = run(capsys, *argv, "--json", str(out_json))
    assert code == 0, err
    assert "4 stages, 2 per rank in a V (rank r holds stages r and 3-r)" in out
    assert "zbv schedule (torch's ScheduleZBVZeroBubble), checkpoint never" in out
    assert "calibrated: torch's multi-stage runtime, zbv: the runner costs" in out
    # The recorder times both stages of a rank and zero bubble's two backward halves.
    assert "predicted from in-place figures" in out
    assert "a backward its input and weight parts together" in out
    assert "optimal: the best 4-stage split by the replayed V schedule" in out
    lines = out.splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("split "))
    assert lines[table].split()[:6] == [
        "split",
        "balance",
        "measured",
        "spread",
        "predicted",
        "meas/pred",
    ]
    assert lines[table + 1].startswith("optimal")
    assert "measured per rank, its stages together" in out
    record = json.loads(out_json.read_text())
    settings = record["settings"]
    assert settings["schedule"] == "zbv" and settings["stages"] == 4
    assert settings["stages_per_rank"] == 2 and settings["checkpoint"] == "never"
    (split,) = record["splits"]
    assert len(split["balance"]) == 4 and sum(split["balance"]) == 5
    assert split["measured"] > 0 and split["predicted"] > 0 and len(split["times"]) == 2
    assert len(split["saved_peak"]) == 2  # one count per rank
    assert record["plans"]["optimal"]["schedule"] == "zbv"
    stages = record["in_place"]["optimal"]["stages"]
    assert len(stages) == 4 and all(s["forward"] > 0 and s["backward"] > 0 for s in stages)


@pytest.mark.parametrize(
    ("options", "message"),
    [(["--steps", "0"], "expected a positive integer"), (["--warmup", "-1"], "non-negative")],
)
def test_bench_usage_errors(
    capsys: pytest.CaptureFixture[str], model_file: str, options: list[str], message: str
) -> None:
    code, out, err = run(capsys, "bench", model_file, *options)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("autopipe bench: error:")
    assert message in err


def test_bench_missing_model_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "bench", str(tmp_path / "none.py"), "--stages", "2", *QUICK)
    assert_error(code, out, err, "none.py")


def test_strategies_giving_one_split_are_measured_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Two units on two stages: every strategy, and the given balance, split them [1, 1].
    path = tmp_path / "two.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))\n"
        "sample = torch.randn(8, 4)\n"
    )
    out_json = tmp_path / "bench.json"
    argv = ["bench", str(path), "--stages", "2", *QUICK, "--steps", "2", "--warmup", "0"]
    code, out, err = run(capsys, *argv, "--balance", "1,1", "--json", str(out_json))
    assert code == 0, err
    record = json.loads(out_json.read_text())
    splits = {split["label"]: split for split in record["splits"]}
    assert list(splits) == [*APPLICABLE, "given"]
    first, *others = splits
    assert all(splits[label]["balance"] == [1, 1] for label in splits)
    assert all(splits[label]["times"] == splits[first]["times"] for label in others)
    assert f"{', '.join(others)}: the same split as {first}, measured once" in out
    assert "running 1 split," in err
