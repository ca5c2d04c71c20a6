"""The runner's calibration kept per machine and runtime, and the plans it reaches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopipe.distributed.calibration_cache import (
    apply_runner_calibration,
    cache_file,
    cached_runner_calibration,
    current_runtime_key,
    runtime_key,
    save_runner_calibration,
)
from autopipe.distributed.prepared import Prepared
from autopipe.distributed.setup import setup_on_rank0
from autopipe.planning.pipeline_settings import PipelineSettings
from profiler.calibrate import store_calibration
from tests.support.planning_cases import linear_profile

KEY = {"backend": "gloo", "ranks": 2, "threads": 1, "bound": True}
FIGURES = {"overhead_s": 2e-3, "latency_s": 1e-4, "bandwidth": 1e9, "compute_scale": 1.3}


def test_key_names_every_condition() -> None:
    base = runtime_key(**KEY)
    assert base == runtime_key(**KEY)  # the same conditions find the same entry
    for change in ({"ranks": 4}, {"threads": 2}, {"bound": False}, {"backend": "nccl"}):
        assert runtime_key(**{**KEY, **change}) != base
    # The schedule matters only on torch's multi-stage runtime.
    assert runtime_key(**KEY, schedule="gpipe") == base
    assert runtime_key(**KEY, schedule="zb") != base
    assert runtime_key(**KEY, virtual_stages=2) != runtime_key(
        **KEY, virtual_stages=2, schedule="gpipe"
    )
    assert json.loads(base)["torch"] == torch.__version__


def test_saved_figures_come_back_and_others_stay_out(calibration_cache: Path) -> None:
    key = runtime_key(**KEY)
    assert cache_file() == calibration_cache
    assert cached_runner_calibration(key) is None
    save_runner_calibration(key, FIGURES)
    found = cached_runner_calibration(key)
    assert found is not None and found["overhead_s"] == 2e-3 and found["bandwidth"] == 1e9
    # A model's compute scale is not the runner's: it is not kept for other models.
    assert "compute_scale" not in found and found["measured_at"] > 0
    assert cached_runner_calibration(runtime_key(**{**KEY, "ranks": 3})) is None
    save_runner_calibration(key, {**FIGURES, "overhead_s": 3e-3})  # measured again
    assert cached_runner_calibration(key)["overhead_s"] == 3e-3  # type: ignore[index]


def test_a_damaged_cache_is_measured_again(calibration_cache: Path) -> None:
    calibration_cache.parent.mkdir(parents=True)
    calibration_cache.write_text("{not json")
    key = runtime_key(**KEY)
    assert cached_runner_calibration(key) is None
    save_runner_calibration(key, FIGURES)
    assert cached_runner_calibration(key) is not None


def test_applying_keeps_the_models_own_scales() -> None:
    profile = linear_profile([1.0, 2.0])
    store_calibration(profile, compute_scale=1.2, overhead_s=9.0)
    apply_runner_calibration(profile, {"overhead_s": 2e-3, "latency_s": 1e-4})
    assert profile.meta["calibration"] == {
        "compute_scale": 1.2,
        "overhead_s": 2e-3,
        "latency_s": 1e-4,
    }


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _plan_overhead(profile: object) -> float:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    sample = torch.randn(4, 4)
    settings = PipelineSettings(chunks=2, schedule="1f1b")
    plan, _ = setup_on_rank0(
        Prepared(model, sample), sample, 2, torch.device("cpu"), None, profile, settings
    )
    return plan.stages[0].overhead


@pytest.mark.usefixtures("one_rank")
def test_rank0_plans_with_the_cached_calibration() -> None:
    profile = linear_profile([1e-3, 1e-3], batch=4, chunks=2)
    assert _plan_overhead(profile) == 0.0  # nothing cached: uncalibrated as before
    save_runner_calibration(current_runtime_key(2, "1f1b"), FIGURES)
    assert _plan_overhead(profile) == pytest.approx(2e-3)
    assert "calibration" not in profile.meta  # the caller's profile is left as it was
    # A profile calibrated for this run keeps its own figures.
    store_calibration(profile, overhead_s=5e-3)
    assert _plan_overhead(profile) == pytest.approx(5e-3)
