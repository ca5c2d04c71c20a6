"""Tests of what the commands read: model files, saved profiles matched to their model
(autopipe.cli.inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.cli import entry
from autopipe.planning.model.plans import Plan
from profiler.profile import Profile
from tests.support.cli_support import (
    FAST,
    RESIDUAL_MODEL,
    SMALL_MODEL,
    assert_error,
    run,
)

# Bad model files: exit 2, one line on stderr, no traceback, no file written.
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


OTHER = SMALL_MODEL.replace("nn.Linear(8, 2)", "nn.Linear(8, 3)")


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
    model.write_text(SMALL_MODEL)
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
    larger.write_text(SMALL_MODEL.replace("torch.randn(8, 4)", "torch.randn(16, 4)"))
    out_file = tmp_path / "plan.json"
    argv = ["plan", str(larger), "--profile", str(profile), "--json", str(out_file), *search]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert Plan.load(out_file).batch_size == 16 and Profile.load(profile).batch_size == 8
    code, _, err = run(capsys, *argv, "--batch", "8")
    assert code == 0, err
    assert Plan.load(out_file).batch_size == 8


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
    sequential.write_text(SMALL_MODEL)
    argv = ["plan", str(sequential), "--granularity", "leaves", *FAST]
    assert_error(*run(capsys, *argv), "apply to traced models only")
    code, _, err = run(capsys, "plan", str(path), "--granularity", "rows")
    assert code == 2 and "invalid choice: 'rows'" in err


META_MODEL = """
import torch
from torch import nn

with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
sample = torch.randn(8, 1024)
"""


@pytest.mark.parametrize("command", ["plan", "profile"])
def test_meta_model_larger_than_free_memory_is_refused(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: str,
) -> None:
    import profiler.memory_guard

    # 1 MiB free: less than one 4 MiB layer, which is refused before it gets storage.
    monkeypatch.setattr(profiler.memory_guard, "free_bytes", lambda device: 1 << 20)
    path = tmp_path / "giant.py"
    path.write_text(META_MODEL)
    output = tmp_path / "out.json"
    where = ["--json", str(output)] if command == "plan" else ["-o", str(output)]
    code, out, err = run(capsys, command, str(path), *where, *FAST)
    assert_error(code, out, err, "measuring layer 0 (Linear) needs")
    assert "the host has 1.00 MiB free" in err
    assert "--target DEVICE" in err and "make `sample` smaller" in err
    assert not output.exists()
