"""``autopipe plan --target``: plans for catalog devices from counted layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.planning.model.plans import Plan
from tests.support.cli_support import FAST, MLP, assert_error, run

META_MODEL = """import torch
from torch import nn

def model():
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)], nn.Linear(1024, 10))

def sample():
    return torch.randn(32, 1024)
"""


@pytest.fixture
def meta_model(tmp_path: Path) -> Path:
    path = tmp_path / "meta_model.py"
    path.write_text(META_MODEL)
    return path


def test_a_meta_model_is_planned_for_a_catalog_device(
    capsys: pytest.CaptureFixture[str], meta_model: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        str(meta_model),
        "--target",
        "h100",
        "--stages",
        "2",
        "--json",
        str(out_file),
    )
    assert code == 0, err
    assert "times estimated for" in out and "(h100)" in out
    assert "not measured" in out
    plan = Plan.load(out_file)
    assert plan.profile["meta"]["estimate"]["target"] == "h100"
    assert [stage.device for stage in plan.stages] == ["h100:0", "h100:1"]
    # 80 GB of H100 memory is every stage's capacity.
    assert all(stage.capacity == 80e9 for stage in plan.stages)
    # Six equal blocks and a small head: the estimate balances the blocks.
    assert sum(plan.balance) == 7 and max(plan.balance) - min(plan.balance) <= 1


def test_peak_dtype_float8_prices_the_target_at_its_fp8_peak(
    capsys: pytest.CaptureFixture[str], meta_model: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    code, _, err = run(
        capsys, "plan", str(meta_model), "--target", "h100", "--peak-dtype", "float8",
        "--stages", "2", "--json", str(out_file),
    )  # fmt: skip
    assert code == 0, err
    estimate = Plan.load(out_file).profile["meta"]["estimate"]
    assert (estimate["dtype"], estimate["attention_peak_flops"]) == ("float8", 989.4e12)
    assert "no shard counts" in estimate["note"]  # counted without --tp-plan


def test_a_real_model_is_counted_not_timed_for_a_target(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", MLP, "--target", "a100-80gb", "--json", str(out_file))
    assert code == 0, err
    layers = Plan.load(out_file).profile["layers"]
    assert all(layer["flops"] and layer["flops"][0] >= 0 for layer in layers)
    assert "A100" in out


DOUBLE_MODEL = """import torch
from torch import nn

model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).double()
sample = torch.randn(16, 64, dtype=torch.float64)
"""


@pytest.mark.parametrize("target", ["h100", "l40s"])
def test_a_float64_model_is_planned_for_a_catalog_device(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str
) -> None:
    path = tmp_path / "double.py"
    path.write_text(DOUBLE_MODEL)
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", str(path), "--target", target, "--json", str(out_file))
    assert code == 0, err
    assert "dtype float64" in out
    assert Plan.load(out_file).profile["meta"]["estimate"]["dtype"] == "float64"


def test_search_for_a_target(capsys: pytest.CaptureFixture[str], meta_model: Path) -> None:
    argv = ["plan", str(meta_model), "--target", "h100", "--search", "--devices", "16"]
    code, out, err = run(capsys, *argv, "--per-node", "8")
    assert code == 0, err
    assert "the best plan:" in out and "times estimated for" in out


def test_memory_overrides_the_catalog_capacity(
    capsys: pytest.CaptureFixture[str], meta_model: Path
) -> None:
    argv = ["plan", str(meta_model), "--target", "h100", "--stages", "2"]
    code, out, err = run(capsys, *argv, "--memory", "1MiB")
    assert_error(code, out, err, "needs")


def test_fit_to_a_measured_profile(
    capsys: pytest.CaptureFixture[str], meta_model: Path, tmp_path: Path
) -> None:
    measured = tmp_path / "measured.json"
    code, _, err = run(capsys, "profile", MLP, "-o", str(measured), *FAST)
    assert code == 0, err
    code, out, err = run(
        capsys, "plan", MLP, "--target", "h100", "--stages", "2", "--fit", str(measured)
    )
    assert code == 0, err
    assert f"fit to {measured}:" in err
    assert "fitted" in out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--target", "nosuch"], "h100"),
        (["--per-node", "4"], "--target"),
        (["--fit", "x.json"], "--target"),
        (["--catalog", "x.toml"], "--target"),
        (["--peak-dtype", "float8"], "--target"),
        (["--target", "h100", "--catalog", "missing.toml"], "missing.toml"),
    ],
)
def test_bad_target_options(
    capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    assert_error(*run(capsys, "plan", MLP, "--stages", "2", *extra), expected)


def test_a_bad_catalog_entry_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    catalog = tmp_path / "mine.toml"
    catalog.write_text('[mygpu]\nname = "My GPU"\nmemory = "24GB"\n')
    argv = ["plan", MLP, "--target", "mygpu", "--catalog", str(catalog)]
    assert_error(*run(capsys, *argv), "mygpu")


def test_a_profile_without_counts_cannot_be_estimated(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.support.planning_cases import linear_profile

    path = tmp_path / "uncounted.json"
    linear_profile([1.0, 2.0], params=[10, 10], batch=8).save(path)
    argv = ["plan", "--profile", str(path), "--target", "h100", "--stages", "2"]
    assert_error(*run(capsys, *argv), "count")


def test_a_catalog_that_is_not_utf8_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    catalog = tmp_path / "latin1.toml"
    catalog.write_bytes('[mygpu]\nname = "Gr\xe4fik"\n'.encode("latin-1"))
    code, out, err = run(capsys, "plan", MLP, "--target", "mygpu", "--catalog", str(catalog))
    assert_error(code, out, err, f"{catalog}: not UTF-8 text (byte 0xe4")
