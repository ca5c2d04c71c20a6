"""Tests of the ``autopipe`` command line (autopipe.cli)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import autopipe
from autopipe.cli import entry, options
from autopipe.cli.arguments import GRANULARITIES as CLI_GRANULARITIES
from autopipe.planning.layer_costs import ProfileLines
from autopipe.planning.planner import default_chunks, evaluate
from autopipe.planning.plans import Plan
from profiler.fit import segments
from profiler.profile import Profile
from tests.support.cli_support import (
    FAST,
    MLP,
    RESIDUAL_MODEL,
    ROOT,
    assert_error,
    make_profile_file,
    run,
)

GOOD = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
sample = torch.randn(8, 4)
"""


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_profile_file(tmp_path_factory)


def test_plan_example(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", MLP, *FAST, "--json", str(out_file))
    assert code == 0, err
    result = Plan.load(out_file)
    assert sum(result.balance) == 16 and len(result.balance) == 2
    assert result.chunks == 8 and result.micro_batch == 4  # 4 x stages by default
    assert f"balance     {result.balance}" in out
    assert "16 layers on 2 stages" in out
    assert "(embed.." in out and "..head)" in out
    assert "uniform [8, 8]" in out
    profile = Profile.from_dict(result.profile)
    uniform = evaluate(profile, [8, 8], chunks=result.chunks)
    assert result.step_time <= uniform.step_time * (1 + 1e-9)
    assert "plan written to" in err and "Traceback" not in err


def test_plan_hugging_face_example(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out_file = tmp_path / "plan.json"
    example = str(ROOT / "examples" / "gpt2.py")
    argv = ["plan", example, *FAST, "--stages", "4", "--chunks", "4", "--json", str(out_file)]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "17 layers on 4 stages" in out and "..lm_head)" in out
    result = Plan.load(out_file)
    # Traced and cut between blocks: embeddings, 12 blocks, final norm, LM head.
    assert len(result.balance) == 4 and sum(result.balance) >= 14
    assert result.stages[-1].layers[-1] == "lm_head"
    blocks = [name for stage in result.stages for name in stage.layers if "/h/" in name]
    assert len(blocks) == 12
    assert "Traceback" not in err


def test_profile_command(profile_file: Path) -> None:
    profile = Profile.load(profile_file)
    assert len(profile) == 16
    assert profile.names[0] == "embed" and profile.layers[0].kind == "Linear"
    assert profile.batch_size == 32 and profile.chunks == 8
    assert profile.batch_sizes == [2, 4]


def test_plan_from_profile(capsys: pytest.CaptureFixture[str], profile_file: Path) -> None:
    code, out, err = run(capsys, "plan", "--profile", str(profile_file), "--stages", "3")
    assert code == 0, err
    assert "16 layers on 3 stages" in out
    assert "12 micro-batches" in out or "11 micro-batches" in out  # 4 x 3, capped by 32
    assert "uniform [6, 5, 5]" in out


def test_plan_options(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        "--profile",
        str(profile_file),
        "--stages",
        "2",
        "--chunks",
        "4",
        "--memory",
        "1GiB,2GiB",
        "--checkpoint",
        "never",
        "--schedule",
        "1f1b",
        "--optimizer",
        "sgd",
        "--bandwidth",
        "10GB/s",
        "--json",
        str(out_file),
    )
    assert code == 0, err
    result = Plan.load(out_file)
    assert result.chunks == 4 and result.checkpoint == "never" and result.schedule == "1f1b"
    assert [s.capacity for s in result.stages] == [2**30, 2**31]
    assert result.devices[0].bandwidth == 1e10
    assert "of which send" in out and "/ 1.00 GiB" in out


def test_uniform_strategy_compares_with_optimal(
    capsys: pytest.CaptureFixture[str], profile_file: Path
) -> None:
    code, out, _ = run(capsys, "plan", "--profile", str(profile_file), "--strategy", "uniform")
    assert code == 0
    assert "balance     [8, 8]" in out
    assert "optimal [" in out


def test_cuda_profile_names_stage_devices(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    profile = Profile.load(profile_file)
    profile.device = "cuda:0"
    path = tmp_path / "cuda.json"
    profile.save(path)
    out_file = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "--profile", str(path), "--json", str(out_file))
    assert code == 0
    assert [s.device for s in Plan.load(out_file).stages] == ["cuda:0", "cuda:1"]


def test_virtual_stages(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile_file), "--stages", "2", "--virtual-stages", "2"]
    argv += ["--schedule", "1f1b", "--chunks", "4", "--memory", "1GiB,2GiB"]
    code, out, err = run(capsys, *argv, "--json", str(out_file))
    assert code == 0, err
    assert "16 layers on 4 stages [cpu] on 2 devices, 2 per device (interleaved)" in out
    assert "per device (its stages together)" in out
    result = Plan.load(out_file)
    assert result.virtual_stages == 2 and result.num_devices == 2
    assert result.checkpoint == "never"  # torch's interleaved schedules keep activations
    assert [s.capacity for s in result.stages] == [2**30, 2**31, 2**30, 2**31]
    picture = tmp_path / "t.png"  # one row per device, its two stages hatched apart
    code, _, err = run(capsys, *argv, "--timeline", str(picture))
    assert code == 0, err
    assert picture.read_bytes().startswith(b"\x89PNG")
    # With --search: 1 or 2 stages per device are both configurations of the search.
    search = ["plan", "--profile", str(profile_file), "--search", "--devices", "2"]
    code, out, err = run(capsys, *search, "--virtual-stages", "2", "--top", "200")
    assert code == 0, err
    assert "interleaved 1f1b, 2 stages per device" in out and "looped bfs" in out
    assert "interleaved by replayed schedules" in out


def test_subprocess() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "autopipe", "plan", "examples/mlp.py", *FAST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "balance" in proc.stdout and "uniform [8, 8]" in proc.stdout
    assert proc.stderr == ""


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_chunks(2, 32) == 8
    assert default_chunks(4, 8) == 4  # micro-batches of 2: batch norm cannot train on 1
    assert default_chunks(2, 3) == 1
    assert default_chunks(3, 1) == 1
    monkeypatch.setattr(options, "_gpu_count", lambda: 0)
    assert options.default_stages() == 2 and options.default_device() == "cpu"
    monkeypatch.setattr(options, "_gpu_count", lambda: 1)
    assert options.default_stages() == 2 and options.default_device() == "cuda:0"
    monkeypatch.setattr(options, "_gpu_count", lambda: 8)
    assert options.default_stages() == 8


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0 and "--stages" in out and "nn.Sequential" in out
    for option in ("--granularity", "--leaf-modules", "--warmup", "--virtual-stages"):
        assert option in out
    code, out, _ = run(capsys, "--help")
    text = " ".join(out.split())
    assert code == 0 and "any nn.Module" in text and "`kwargs`" in text
    assert "an nn.Sequential (or a function returning one)" not in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--version")
    assert (code, out, err) == (0, f"autopipe {autopipe.__version__}\n", "")
    assert autopipe.__version__ == "0.1.0"


def test_granularities_match_the_tracer() -> None:
    from autopipe.graph.units import GRANULARITIES

    assert CLI_GRANULARITIES == GRANULARITIES


def test_wrap_defaults_to_the_command_lines_chunks() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    wrapped = autopipe.wrap(model, torch.randn(32, 4), stages=2)
    try:
        assert wrapped.plan.chunks == default_chunks(2, 32) == 8
    finally:
        wrapped.close()


# ----------------------------------------------------------------------------------------
# Bad input: exit 2, one line on stderr, no traceback, no file written.

BAD_FILES = {
    "syntax.py": ("import torch\nmodel = (\n", "line 2"),
    "raises.py": ("import torch\nraise RuntimeError('boom')\n", "RuntimeError: boom"),
    "nomodel.py": ("import torch\nsample = torch.randn(4, 4)\n", "defines no `model`"),
    "nosample.py": (
        "from torch import nn\nmodel = nn.Sequential(nn.Linear(4, 4))\n",
        "defines no `sample`",
    ),
    "untraceable.py": (
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.a(x) if x.sum() > 0 else x\n"
        "model = Net()\nsample = torch.randn(4, 4)\n",
        "cannot split `model`",
    ),
    "badtype.py": ("import torch\nmodel = 'net'\nsample = torch.randn(4, 4)\n", "nn.Module"),
    "shapes.py": (
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 5))\nsample = torch.randn(4, 4)\n",
        "profiling layer 1 (1: Linear) failed: RuntimeError",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_model_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str) -> None:
    text, expected = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    out_file = tmp_path / "plan.json"
    assert_error(*run(capsys, "plan", str(path), *FAST, "--json", str(out_file)), expected)
    assert not out_file.exists()
    profile_out = tmp_path / "profile.json"
    assert_error(*run(capsys, "profile", str(path), "-o", str(profile_out), *FAST), expected)
    assert not profile_out.exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--memory", "16XB"], "cannot parse memory size '16XB'"),
        (["--memory", "1GB,2GB,3GB"], "--memory lists 3 sizes but there are 2 stages"),
        (["--memory", "1KB"], "does not fit"),
        (["--stages", "20"], "cannot split 16 layers into 20"),
        (["--bandwidth", "fast"], "cannot parse bandwidth 'fast'"),
        (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    ],
)
def test_bad_plan_options(
    capsys: pytest.CaptureFixture[str],
    profile_file: Path,
    tmp_path: Path,
    args: list[str],
    expected: str,
) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile_file), *args, "--json", str(out_file)]
    assert_error(*run(capsys, *argv), expected)
    assert not out_file.exists()


def test_too_many_stages_before_profiling(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    assert_error(*run(capsys, "plan", str(path), "--stages", "4"), "use --stages 3 or fewer")


def test_missing_model_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert_error(*run(capsys, "plan", str(tmp_path / "missing.py")), "not found")
    assert_error(*run(capsys, "plan"), "give a model file")


def test_bad_profile_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, profile_file: Path
) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert_error(*run(capsys, "plan", "--profile", str(garbage)), "not valid JSON")
    assert_error(*run(capsys, "plan", "--profile", str(tmp_path / "none.json")), "cannot read")
    plan_file = tmp_path / "plan.json"
    assert run(capsys, "plan", "--profile", str(profile_file), "--json", str(plan_file))[0] == 0
    assert_error(*run(capsys, "plan", "--profile", str(plan_file)), "not an autopipe profile")


def test_unwritable_outputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, profile_file: Path
) -> None:
    missing_dir = tmp_path / "no" / "such" / "plan.json"
    argv = ["plan", "--profile", str(profile_file), "--json", str(missing_dir)]
    assert_error(*run(capsys, *argv), "does not exist")
    argv = ["plan", "--profile", str(profile_file), "--json", str(tmp_path)]
    assert_error(*run(capsys, *argv), "is a directory")
    assert_error(*run(capsys, "profile", MLP, "-o", str(missing_dir), *FAST), "does not exist")
    assert not missing_dir.parent.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    argv = ["plan", str(path), "--device", "cuda:0", *FAST]
    assert_error(*run(capsys, *argv), "CUDA is not available")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["plan", "--stages", "0", MLP],
        ["plan", "--checkpoint", "sometimes", MLP],
        ["plan", "--chunks", "x", MLP],
        ["profile", MLP],
    ],
)
def test_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == "" and "Traceback" not in err
    # One line, like every other error, with where to read more instead of the usage.
    (line,) = err.splitlines()
    command = f"autopipe {argv[0]}" if argv[:1] in (["plan"], ["profile"]) else "autopipe"
    assert line.startswith(f"{command}: error: ") and line.endswith(f"(see {command} --help)")


def test_interrupted_anywhere_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before any command runs: while the parser is built (and torch or scipy imported).
    def interrupt(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(entry, "build_parser", interrupt)
        code, out, err = run(capsys, "plan", MLP)
    assert (code, out, err) == (130, "", "autopipe: interrupted\n")


def test_interrupted_while_saving_leaves_no_file(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    profile_file: Path,
    tmp_path: Path,
) -> None:
    from profiler import jsonfile

    def interrupt(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonfile.os, "replace", interrupt)
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--profile", str(profile_file), "--json", str(out_file))
    assert (code, out, err) == (130, "", "autopipe: interrupted\n")
    assert list(tmp_path.iterdir()) == []


def test_plan_non_sequential_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)
    out_json = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", str(path), "--stages", "2", *FAST, "--json", str(out_json))
    assert code == 0, err
    plan = Plan.load(out_json)
    # Units: inp, blocks/0..3, out — cut along module calls.
    assert sum(plan.balance) == 6 and len(plan.balance) == 2
    assert "(inp.." in out and "..out)" in out


# ----------------------------------------------------------------------------------------
# plan --search and calibrate.


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


@pytest.mark.parametrize(
    ("args", "expected"),
    [
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


def test_calibrate(capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "calibrated.json"
    argv = ["calibrate", str(profile_file), "-o", str(out_file), "--repeats", "2"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "executor overhead" in out and "copies at" in out
    calibration = Profile.load(out_file).meta["calibration"]
    assert calibration["overhead_s"] >= 0 and calibration["bandwidth"] > 0
    plan_file = tmp_path / "plan.json"
    code, _, err = run(capsys, "plan", "--profile", str(out_file), "--json", str(plan_file))
    assert code == 0, err
    result = Plan.load(plan_file)
    assert result.devices[0].bandwidth == pytest.approx(calibration["bandwidth"])
    assert result.stages[0].overhead == pytest.approx(calibration["overhead_s"])


def test_calibrate_with_the_model_scales_compute(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "calibrated.json"
    argv = ["calibrate", str(profile_file), "-o", str(out_file), "--repeats", "2", "--model", MLP]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "in a whole step layers run" in out
    calibration = Profile.load(out_file).meta["calibration"]
    assert calibration["compute_scale"] > 0 and calibration["fixed_scale"] > 0
    plain = autopipe.plan(Profile.load(profile_file), 2)
    scaled = autopipe.plan(Profile.load(out_file), 2, overhead=0.0, bandwidth=1e30)
    # Each layer time a + b·size becomes fixed_scale·a + compute_scale·b·size. (A ratio of
    # totals need not lie between the two scales: a segment's a can be negative.)
    size = plain.batch_size / plain.chunks
    base = ProfileLines.from_profile(Profile.load(profile_file))
    lines = ProfileLines.from_profile(Profile.load(out_file))
    for figure in ("forward", "backward"):
        a, b = segments(base.sizes, base.values[figure], size)
        expected = np.maximum(
            calibration["fixed_scale"] * a + calibration["compute_scale"] * b * size, 0.0
        )
        np.testing.assert_allclose(lines.figure(figure, size), expected, rtol=1e-9)
    forward = lines.figure("forward", size).sum()
    assert sum(s.forward for s in scaled.stages) == pytest.approx(forward, rel=1e-9)
    other = tmp_path / "other.py"
    other.write_text(GOOD)
    argv = ["calibrate", str(profile_file), "-o", str(tmp_path / "x.json"), "--model", str(other)]
    assert_error(*run(capsys, *argv), "pass the model file the profile was made from")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ("nope", "--devices 'nope' is not a device"),
        ("", "--devices lists no devices"),
        (" , ", "--devices lists no devices"),
        ("cpu,", "--devices 'cpu,' has an empty entry"),
        ("cpu,meta", "--devices meta: meta tensors hold no data"),
    ],
)
def test_calibrate_bad_devices(
    capsys: pytest.CaptureFixture[str],
    profile_file: Path,
    tmp_path: Path,
    devices: str,
    expected: str,
) -> None:
    out_file = tmp_path / "x.json"
    argv = ["calibrate", str(profile_file), "-o", str(out_file), "--devices", devices]
    assert_error(*run(capsys, *argv), expected)
    assert not out_file.exists()


def test_plan_batch_and_auto(capsys: pytest.CaptureFixture[str], profile_file: Path) -> None:
    argv = ["plan", "--profile", str(profile_file), "--batch", "16", "--checkpoint", "auto"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "batch 16 as 8 micro-batches of 2" in out and "checkpoint auto (" in out
    assert_error(*run(capsys, "plan", "--profile", str(profile_file), "--devices", "4"), "--search")
    assert_error(*run(capsys, "plan", "--profile", str(profile_file), "--even"), "--search")
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "2", "--even"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err


# ----------------------------------------------------------------------------------------
# Mixed precision: --autocast and --dtype.


def test_profile_with_autocast_and_dtype(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "bf16.json"
    argv = ["profile", MLP, "-o", str(out_file), "--autocast", "bfloat16", "--dtype", "bfloat16"]
    code, out, err = run(capsys, *argv, *FAST)
    assert code == 0, err
    assert "(dtype bfloat16, autocast bfloat16)" in out
    half, full = Profile.load(out_file), Profile.load(profile_file)
    assert (half.autocast, half.dtype) == ("bfloat16", "bfloat16")
    assert (full.autocast, full.dtype) == (None, "float32")
    assert [2 * layer.param_bytes for layer in half.layers] == [
        layer.param_bytes for layer in full.layers
    ]
    assert half.input == [n // 2 for n in full.input]  # the sample is cast too
    code, out, err = run(capsys, "plan", "--profile", str(out_file))
    assert code == 0, err
    assert "optimizer adam, dtype bfloat16, autocast bfloat16" in out
    argv = ["plan", "--profile", str(out_file), "--autocast", "bfloat16", "--dtype", "bfloat16"]
    assert run(capsys, *argv)[0] == 0
    argv = ["plan", "--profile", str(out_file), "--autocast", "float16"]
    assert_error(*run(capsys, *argv), "profiled with autocast bfloat16, not --autocast float16")
    argv = ["plan", "--profile", str(profile_file), "--dtype", "bfloat16", "--search"]
    assert_error(*run(capsys, *argv), "profiled with dtype float32, not --dtype bfloat16")


def test_plan_under_autocast_names_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    plan_file = tmp_path / "plan.json"
    argv = ["plan", str(path), "--autocast", "float16", "--json", str(plan_file), *FAST]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "optimizer adam, autocast float16\n" in out and "dtype" not in out
    assert Plan.load(plan_file).profile["autocast"] == "float16"
    code, out, err = run(capsys, "plan", str(path), *FAST)
    assert code == 0, err
    assert "autocast" not in out and "dtype" not in out


def test_dtype_casts_models_that_are_traced(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)
    params = {}
    for dtype in ("float32", "bfloat16"):
        plan_file = tmp_path / f"{dtype}.json"
        argv = ["plan", str(path), "--dtype", dtype, "--json", str(plan_file), *FAST]
        code, _, err = run(capsys, *argv)
        assert code == 0, err
        profile = Profile.from_dict(Plan.load(plan_file).profile)
        assert profile.dtype == dtype and profile.autocast is None
        params[dtype] = sum(layer.param_bytes for layer in profile.layers)
    assert params["bfloat16"] * 2 == params["float32"] > 0


def test_calibrate_casts_the_model_as_profiled(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autopipe.gpipe import executor_calibration as calibration
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    measure = calibration.measure_compute_scale

    def recording(
        model: torch.nn.Sequential, sample: torch.Tensor, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        seen.append((next(model.parameters()).dtype, sample.dtype))
        return measure(model, sample, *args, **kwargs)

    monkeypatch.setattr(calibration, "measure_compute_scale", recording)
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    profile_path = tmp_path / "profile.json"
    argv = ["profile", str(path), "-o", str(profile_path), "--dtype", "bfloat16"]
    assert run(capsys, *argv, "--autocast", "bfloat16", *FAST)[0] == 0
    argv = ["calibrate", str(profile_path), "--model", str(path), "--repeats", "1"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "in a whole step layers run" in out
    assert seen == [(torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", MLP, "--autocast", "fp8"], "--autocast must be bfloat16 or float16, got 'fp8'"),
        (["plan", MLP, "--autocast", "float32"], "--autocast must be bfloat16 or float16"),
        (["plan", MLP, "--dtype", "int8"], "--dtype must be float32, bfloat16 or float16"),
        (["plan", MLP, "--search", "--autocast", "half"], "--autocast must be"),
        (["profile", MLP, "--dtype", "float64"], "got 'float64'"),
        (["profile", MLP, "--autocast", "bf16"], "got 'bf16'"),
    ],
)
def test_bad_precision_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], expected: str
) -> None:
    out_file = tmp_path / "out.json"
    option = "-o" if argv[0] == "profile" else "--json"
    assert_error(*run(capsys, *argv, option, str(out_file)), expected)
    assert not out_file.exists()
    code, out, _ = run(capsys, argv[0], "--help")
    assert code == 0 and "--autocast {bfloat16,float16}" in out
    assert "--dtype {float32,bfloat16,float16}" in out


# ----------------------------------------------------------------------------------------
# A profile checked against its model, devices checked up front, tracing options, kwargs.

OTHER = GOOD.replace("nn.Linear(8, 2)", "nn.Linear(8, 3)")

# A submodule torch.fx cannot trace through, and a keyword input the model requires.
GATED_MODEL = """import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.gate = Gate()
        self.out = nn.Linear(8, 2)

    def forward(self, x, *, scale):
        return self.out(self.gate(self.inp(x) * scale))


model = Gated()
sample = torch.randn(8, 4)
kwargs = lambda: {"scale": torch.full((8, 1), 2.0)}
"""


@pytest.fixture(scope="module")
def good_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("good")
    model, profile = folder / "good.py", folder / "good.json"
    model.write_text(GOOD)
    assert entry.main(["profile", str(model), "-o", str(profile), *FAST]) == 0
    return model, profile


@pytest.mark.parametrize("search", [[], ["--search", "--devices", "2"]])
def test_profile_of_another_model_is_refused(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    good_profile: tuple[Path, Path],
    profile_file: Path,
    search: list[str],
) -> None:
    model, profile = good_profile
    code, _, err = run(capsys, "plan", str(model), "--profile", str(profile), *search)
    assert code == 0, err
    other = tmp_path / "other.py"
    other.write_text(OTHER)
    out_file = tmp_path / "plan.json"
    argv = ["plan", str(other), "--profile", str(profile), "--json", str(out_file), *search]
    expected = f"{profile} does not match {other}: layer 2 is '2' (Linear, 72 B of parameters)"
    assert_error(*run(capsys, *argv), expected)
    argv = ["plan", str(other), "--profile", str(profile_file), *search]
    assert_error(*run(capsys, *argv), "the profile has 16 layers, the model 3")
    assert not out_file.exists()


def test_profile_mismatch_names_both_figures(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, good_profile: tuple[Path, Path]
) -> None:
    _, profile = good_profile
    other = tmp_path / "other.py"
    other.write_text(OTHER)
    code, out, err = run(capsys, "plan", str(other), "--profile", str(profile))
    assert_error(code, out, err, "in the profile but '2' (Linear, 108 B of parameters) in the")
    assert f"profile {other} again (autopipe profile {other} -o {profile})" in err


@pytest.mark.parametrize("search", [[], ["--search", "--devices", "2"]])
def test_plan_from_a_profile_is_for_the_models_batch(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    good_profile: tuple[Path, Path],
    search: list[str],
) -> None:
    _, profile = good_profile
    larger = tmp_path / "larger.py"
    larger.write_text(GOOD.replace("torch.randn(8, 4)", "torch.randn(16, 4)"))
    out_file = tmp_path / "plan.json"
    argv = ["plan", str(larger), "--profile", str(profile), "--json", str(out_file), *search]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert Plan.load(out_file).batch_size == 16 and Profile.load(profile).batch_size == 8
    code, _, err = run(capsys, *argv, "--batch", "8")
    assert code == 0, err
    assert Plan.load(out_file).batch_size == 8


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("meta", "--device meta: meta tensors hold no data"),
        ("nonsense", "--device 'nonsense' is not a device: use cpu, cuda or cuda:N"),
        ("", "--device '' is not a device"),
        ("cuda:x", "--device 'cuda:x' is not a device"),
    ],
)
def test_device_is_checked_before_anything_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, device: str, expected: str
) -> None:
    # The model file would fail to import: the device is refused first.
    path = tmp_path / "raises.py"
    path.write_text("raise RuntimeError('imported')\n")
    out_file = tmp_path / "out.json"
    argv = ["plan", str(path), "--device", device, "--json", str(out_file)]
    assert_error(*run(capsys, *argv), expected)
    assert_error(*run(capsys, "profile", str(path), "--device", device, "-o", str(out_file)))
    assert not out_file.exists()


def test_kwargs_and_leaf_modules(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "gated.py"
    path.write_text(GATED_MODEL)
    # torch.fx cannot trace Gate, nor torch.export: the advice names the option.
    code, out, err = run(capsys, "plan", str(path), *FAST)
    assert_error(code, out, err, "(--leaf-modules gate)")
    plan_file = tmp_path / "plan.json"
    argv = ["plan", str(path), "--leaf-modules", "gate", "--json", str(plan_file), *FAST]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    plan = Plan.load(plan_file)
    assert [name for stage in plan.stages for name in stage.layers] == ["inp", "gate", "out"]
    # The keyword input is an input of the profile: two tensors of 8 x 4 and 8 x 1 floats.
    profile = Profile.from_dict(plan.profile)
    micro = profile.batch_sizes[-1]
    assert profile.input[-1] == micro * (4 + 1) * 4
    argv = ["plan", str(path), "--leaf-modules", "gate,nosuch", *FAST]
    assert_error(*run(capsys, *argv), "has no submodule 'nosuch'")


def test_granularity(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)
    counts = {}
    for granularity in ("children", "blocks"):
        plan_file = tmp_path / f"{granularity}.json"
        argv = ["plan", str(path), "--granularity", granularity, "--json", str(plan_file)]
        code, _, err = run(capsys, *argv, *FAST)
        assert code == 0, err
        counts[granularity] = sum(Plan.load(plan_file).balance)
    assert counts == {"children": 3, "blocks": 6}  # inp, blocks, out; or each block apart
    sequential = tmp_path / "good.py"
    sequential.write_text(GOOD)
    argv = ["plan", str(sequential), "--granularity", "leaves", *FAST]
    assert_error(*run(capsys, *argv), "apply to traced models only")
    code, _, err = run(capsys, "plan", str(path), "--granularity", "rows")
    assert code == 2 and "invalid choice: 'rows'" in err


def test_wrap_takes_the_profile_of_autopipe_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)
    profile_path = tmp_path / "residual.json"
    assert run(capsys, "profile", str(path), "-o", str(profile_path), *FAST)[0] == 0
    from autopipe.cli.model_file import load_model_file

    loaded = load_model_file(path)
    reference = copy.deepcopy(loaded.model)
    profile = Profile.load(profile_path)
    wrapped = autopipe.wrap(loaded.model, loaded.sample, stages=2, profile=profile)
    try:
        assert wrapped.plan.chunks == profile.chunks == default_chunks(2, 8)
        assert sum(wrapped.plan.balance) == 6
        expected = torch.cat([reference(part) for part in loaded.sample.tensor_split(4)])
        torch.testing.assert_close(wrapped(loaded.sample), expected)
    finally:
        wrapped.close()
