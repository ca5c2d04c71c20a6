"""Partitions on one physical device, found by the device (autopipe.gpipe.colocated)."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopipe
from autopipe.gpipe import GPipe
from autopipe.gpipe.colocated import colocation_mismatch, device_groups, physical_names
from autopipe.planning.model.quantities import format_time
from profiler import profile_model


def test_names_of_one_device_compare_equal() -> None:
    # A bare "cuda" is the current device, cuda:0 where CUDA is not available.
    assert physical_names(["cpu", "cpu:0", torch.device("cpu"), "cuda", 0]) == [
        "cpu",
        "cpu",
        "cpu",
        "cuda:0",
        "cuda:0",
    ]
    assert device_groups(["cpu", "cuda:0", "cpu:0", "cuda", "cuda:1"]) == [[0, 2], [1, 3]]
    assert device_groups(["cuda:0", "cuda:1"]) == []


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8, dtype=torch.float64) for _ in range(4)]
    return torch.nn.Sequential(*layers)


def test_from_plan_warns_of_a_plan_for_devices_of_their_own() -> None:
    model = _model()
    sample = (torch.randn(8, 8, dtype=torch.float64),)
    profile = profile_model(model, sample, chunks=2, warmup=0, repeats=1)
    apart = autopipe.plan(profile, ["cpu", "cpu"], chunks=2)
    together = autopipe.plan(profile, ["cpu", "cpu"], chunks=2, colocated=True)
    text = colocation_mismatch(apart, ["cpu", "cpu"])
    assert text is not None
    assert "stages 0, 1 share cpu and run one after another" in text
    assert f"at least {format_time(together.step_time)}" in text
    assert "colocated=True" in text
    with pytest.warns(UserWarning, match="stages 0, 1 share cpu"):
        pipe = GPipe.from_plan(model, apart)
    assert pipe.shared_devices == [[0, 1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = GPipe.from_plan(_model(), together)
    assert pipe.shared_devices == together.shared == [[0, 1]]
    # A plan that shares a device, run on devices of their own, mispredicts too.
    assert colocation_mismatch(together, ["cpu", "cuda:0"]) is not None
    assert colocation_mismatch(together, ["cpu:0", "cpu"]) is None
