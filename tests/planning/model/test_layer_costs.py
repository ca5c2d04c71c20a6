"""Saved bytes under float8 estimates (autopipe.planning.model.layer_costs)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from autopipe.output.report import render_header
from autopipe.planning import estimate_profile, plan
from autopipe.planning.hardware.device_catalog import measured_device
from autopipe.planning.hardware.estimates import Efficiency
from autopipe.planning.model.layer_costs import ProfileLines
from profiler.measure import profile_layers
from profiler.profile import Profile

BOX = measured_device(
    {"peak_flops": {"float8": 4e12, "bfloat16": 2e12}, "memory_bandwidth": 1e12, "memory": 1e9},
    key="fp8-box",
)
N, A, B, C = 4, 16, 8, 12  # micro-batch rows and widths


def _counted(layers: list[nn.Module]) -> Profile:
    torch.manual_seed(0)
    return profile_layers(
        layers, torch.randn(N, A), batch_sizes=[N], measure=False, autocast="bfloat16"
    )


def _estimated(profile: Profile, dtype: str) -> Profile:
    return estimate_profile(profile, BOX, efficiency=Efficiency(1.0, 1.0, 0.0), dtype=dtype)


def _activations(profile: Profile, chunks: int = 1) -> float:
    found = plan(profile, 1, chunks=chunks, checkpoint="never", schedule="gpipe")
    return found.stages[0].activation_memory


def test_a_float8_plan_holds_the_gemm_inputs_in_one_byte() -> None:
    stack = nn.Sequential(nn.Linear(A, B), nn.GELU(), nn.Linear(B, C))
    counted = _counted([stack])
    bf16, fp8 = _estimated(counted, "bfloat16"), _estimated(counted, "float8")
    # bfloat16 copies of x (N×A) and of GELU's output (N×B) go to 1 byte each; the rest
    # (GELU's input, the weights' bfloat16 copies) stays.
    assert counted.layers[0].gemm_saved == [2 * N * (A + B)]
    assert _activations(bf16, 1) - _activations(fp8, 1) == N * (A + B)


def test_a_shared_gemm_input_is_held_in_full_before_and_in_fp8_after() -> None:
    counted = _counted([nn.Linear(A, B), nn.ReLU(), nn.Linear(B, C)])
    bf16, fp8 = _estimated(counted, "bfloat16"), _estimated(counted, "float8")
    before = ProfileLines.from_profile(bf16).at(N)
    after = ProfileLines.from_profile(fp8).at(N)
    # Layer 2's input is ReLU's output, which ReLU keeps in bfloat16: no longer shared,
    # the layer holds its FP8 copy (N×B bytes) beside it.
    assert before.shared_bytes.tolist() == [0.0, 0.0, 2 * N * B]
    assert after.shared_bytes.tolist() == [0.0, 0.0, 0.0]
    assert (before.saved - after.saved).tolist() == [N * A, 0.0, N * B]
    held = float(np.sum(before.saved - before.shared_bytes))
    assert held - float(np.sum(after.saved - after.shared_bytes)) == N * A - N * B


def test_older_profiles_and_other_estimates_plan_as_before() -> None:
    counted = _counted([nn.Linear(A, B), nn.GELU(), nn.Linear(B, C)])
    older = dataclasses.replace(
        counted, layers=[dataclasses.replace(x, gemm_saved=None) for x in counted.layers]
    )
    bf16 = _estimated(counted, "bfloat16")
    assert _activations(_estimated(older, "float8"), 2) == _activations(bf16, 2)
    assert "FP8 GEMMs" not in render_header(plan(_estimated(older, "float8"), 1))


def test_the_report_notes_the_fp8_gemm_inputs() -> None:
    fp8 = _estimated(_counted([nn.Linear(A, B)]), "float8")
    header = render_header(plan(fp8, 1))
    assert "float8: activations of FP8 GEMMs saved in 1 byte" in header
    bf16 = _estimated(_counted([nn.Linear(A, B)]), "bfloat16")
    assert "FP8 GEMMs" not in render_header(plan(bf16, 1))
