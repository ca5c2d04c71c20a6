"""Tests of the times estimated from counted FLOPs and bytes
(autopipe.planning.hardware.estimates)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from autopipe.output.report import render_header, render_plan
from autopipe.planning import estimate_profile, find_device, fit_efficiency, plan
from autopipe.planning.hardware.device_catalog import measured_device
from autopipe.planning.hardware.estimates import Efficiency, EfficiencyFit
from autopipe.planning.model.plans import Plan
from profiler.profile import LayerProfile, Profile
from tests.support.mesh_profiles import block_profile

SIZES = [1, 2, 4, 8]
H100 = find_device("h100")


def counted_layer(i: int, flops: float, traffic: float, **extra: object) -> LayerProfile:
    """A layer whose counts grow with the batch; its times are placeholders."""
    figures: dict[str, object] = {
        "name": str(i),
        "kind": "Linear" if flops else "GELU",
        "forward": [1e-3 * b for b in SIZES],
        "backward": [2e-3 * b for b in SIZES],
        "saved": [100 * b for b in SIZES],
        "output": [400 * b for b in SIZES],
        "param_bytes": 1000 * (i + 1),
        "flops": [flops * b for b in SIZES],
        "backward_flops": [2 * flops * b for b in SIZES],
        "backward_input_flops": [flops * b for b in SIZES],
        "traffic": [traffic * (1 + b) for b in SIZES],
        "backward_traffic": [2 * traffic * (1 + b) for b in SIZES],
    }
    figures.update(extra)
    return LayerProfile(**figures)  # type: ignore[arg-type]


def counted_profile(count: int = 8, seed: int = 0, autocast: str | None = "bfloat16") -> Profile:
    """Layers from matmul-heavy to copy-like, some of each regime on the H100."""
    rng = np.random.default_rng(seed)
    layers = [
        counted_layer(
            i, float(rng.uniform(1e9, 1e12)) if i % 3 else 0.0, float(rng.uniform(1e6, 1e9))
        )
        for i in range(count)
    ]
    return Profile(
        layers=layers,
        batch_sizes=SIZES,
        input=[400 * b for b in SIZES],
        batch_size=32,
        chunks=4,
        device="meta",
        device_name="meta",
        autocast=autocast,
        meta={"calibration": {"overhead_s": 1e-3}, "pooled": [[0, 1]]},
    )


def roofline(flops: float, traffic: float, peak: float, bandwidth: float, e: Efficiency) -> float:
    return max(flops / (e.compute * peak), traffic / (e.memory * bandwidth)) + e.overhead


def test_the_estimates_follow_the_formula() -> None:
    profile = counted_profile()
    e = Efficiency(compute=0.5, memory=0.8, overhead=1e-5)
    out = estimate_profile(profile, H100, efficiency=e)
    peak, bw = H100.peak("bfloat16"), H100.memory_bandwidth
    for before, after in zip(profile.layers, out.layers):
        for j in range(len(SIZES)):
            assert before.flops and before.traffic and before.backward_traffic
            assert before.backward_flops and before.backward_input_flops
            forward = roofline(before.flops[j], before.traffic[j], peak, bw, e)
            backward = roofline(before.backward_flops[j], before.backward_traffic[j], peak, bw, e)
            assert after.forward[j] == pytest.approx(forward, rel=1e-12)
            assert after.backward[j] == pytest.approx(backward, rel=1e-12)
            # The input's gradient: its FLOPs, and the traffic in proportion to them.
            total = before.backward_flops[j]
            share = before.backward_input_flops[j] / total if total else 1.0
            part = roofline(
                before.backward_input_flops[j], before.backward_traffic[j] * share, peak, bw, e
            )
            assert after.backward_input is not None
            assert after.backward_input[j] == pytest.approx(min(part, backward), rel=1e-12)


def test_compute_bound_layers_ignore_the_memory_efficiency_and_the_reverse() -> None:
    matmul = counted_layer(0, flops=1e12, traffic=1e6)  # 1e6 FLOP per byte
    copy = counted_layer(1, flops=0.0, traffic=1e9)
    profile = dataclasses.replace(counted_profile(), layers=[matmul, copy])
    base = Efficiency(0.5, 0.5, 0.0)
    out = estimate_profile(profile, H100, efficiency=base)
    slower_memory = estimate_profile(profile, H100, efficiency=Efficiency(0.5, 0.25, 0.0))
    slower_compute = estimate_profile(profile, H100, efficiency=Efficiency(0.25, 0.5, 0.0))
    assert out.layers[0].forward == slower_memory.layers[0].forward
    assert slower_compute.layers[0].forward == pytest.approx([2 * t for t in out.layers[0].forward])
    assert out.layers[0].forward[0] == pytest.approx(1e12 / (0.5 * 989.4e12))
    assert out.layers[1].forward == slower_compute.layers[1].forward
    assert out.layers[1].forward[0] == pytest.approx(2e9 / (0.5 * 3.35e12))


def test_the_peak_is_the_autocast_dtype_else_the_profile_dtype() -> None:
    e = Efficiency(1.0, 1.0, 0.0)
    matmul = [counted_layer(0, flops=1e12, traffic=1.0)]
    mixed = dataclasses.replace(counted_profile(), layers=matmul)
    plain = dataclasses.replace(counted_profile(autocast=None), layers=matmul)
    assert estimate_profile(mixed, H100, efficiency=e).layers[0].forward[0] == 1e12 / 989.4e12
    assert estimate_profile(plain, H100, efficiency=e).layers[0].forward[0] == 1e12 / 66.9e12
    tf32 = estimate_profile(plain, H100, efficiency=e, dtype="tf32")
    assert tf32.layers[0].forward[0] == 1e12 / 494.7e12
    assert tf32.meta["estimate"]["dtype"] == "tf32"
    with pytest.raises(ValueError, match="has no float8 peak.*add peak_flops.float8"):
        estimate_profile(plain, find_device("a100-80gb"), dtype="float8")


def test_float64_matmuls_use_the_fp64_tensor_core_peak() -> None:
    """cuBLAS and rocBLAS run float64 matmuls on the FP64 tensor (matrix) cores."""
    e = Efficiency(1.0, 1.0, 0.0)
    matmul = [counted_layer(0, flops=1e12, traffic=1.0)]
    double = dataclasses.replace(counted_profile(autocast=None), layers=matmul, dtype="float64")
    peaks = {"h100": 67e12, "h200": 67e12, "a100-80gb": 19.5e12, "mi300x": 163.4e12}
    peaks["l40s"] = 91.6e12 / 64  # no FP64 tensor cores: Ada's 1/64 rate
    for key, peak in peaks.items():
        out = estimate_profile(double, find_device(key), efficiency=e)
        assert out.layers[0].forward[0] == pytest.approx(1e12 / peak, rel=1e-3), key
        assert out.meta["estimate"]["dtype"] == "float64"


def test_the_estimate_keeps_counts_and_bytes_and_records_the_target() -> None:
    profile = counted_profile()
    out = estimate_profile(profile, H100)
    assert out.device == "h100" and out.device_name == "NVIDIA H100 SXM5 80GB"
    for before, after in zip(profile.layers, out.layers):
        for what in ("saved", "output", "param_bytes", "flops", "traffic", "backward_traffic"):
            assert getattr(after, what) == getattr(before, what)
    assert (out.batch_sizes, out.input, out.autocast) == (SIZES, profile.input, "bfloat16")
    assert out.meta["estimate"] == {
        "target": "h100",
        "name": "NVIDIA H100 SXM5 80GB",
        "efficiency": {"compute": 0.55, "memory": 0.7, "overhead": 5e-6},
        "fitted": False,
        "dtype": "bfloat16",
        "counted_on": "meta",
        "peak_flops": H100.peak("bfloat16"),
        "memory_bandwidth": H100.memory_bandwidth,
    }
    # The calibration is the profiling machine's runner and links, not the target's.
    assert "calibration" not in out.meta and out.meta["pooled"] == [[0, 1]]
    assert "calibration" in profile.meta and "estimate" not in profile.meta


def test_a_layer_without_a_counted_input_gradient_gets_no_estimate_of_it() -> None:
    layers = [counted_layer(0, 1e9, 1e6, backward_input_flops=None, backward_input=[1.0] * 4)]
    out = estimate_profile(dataclasses.replace(counted_profile(), layers=layers), H100)
    assert out.layers[0].backward_input is None  # not a measured figure among estimates


def test_an_uncounted_profile_is_refused_naming_the_first_uncounted_layer() -> None:
    profile = counted_profile()
    layers = list(profile.layers)
    layers[2] = dataclasses.replace(layers[2], traffic=None)
    layers[5] = dataclasses.replace(layers[5], flops=None)
    uncounted = dataclasses.replace(profile, layers=layers)
    with pytest.raises(ValueError) as info:
        estimate_profile(uncounted, H100)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("layer 2 (Linear '2') has no counted traffic")
    assert "profile the model with counting on" in text
    with pytest.raises(ValueError, match="layer 2 .* no counted traffic"):
        fit_efficiency(uncounted, H100)


def test_efficiencies_must_be_positive_and_finite() -> None:
    for bad in ({"compute": 0.0}, {"memory": -1.0}, {"overhead": float("nan")}):
        with pytest.raises(ValueError, match="must be a finite number"):
            Efficiency(**bad)  # type: ignore[arg-type]


def measured(seed: int = 1, e: Efficiency | None = None) -> Profile:
    """A profile 'measured' on the H100: the model's times under known efficiencies."""
    truth = e or Efficiency(compute=0.43, memory=0.81, overhead=7e-6)
    return estimate_profile(counted_profile(count=12, seed=seed), H100, efficiency=truth)


def test_the_fit_recovers_known_efficiencies_exactly() -> None:
    truth = Efficiency(compute=0.43, memory=0.81, overhead=7e-6)
    fit = fit_efficiency(measured(e=truth), H100)
    assert isinstance(fit, EfficiencyFit) and fit.efficiency.fitted
    assert fit.efficiency.compute == pytest.approx(0.43, rel=1e-9)
    assert fit.efficiency.memory == pytest.approx(0.81, rel=1e-9)
    assert fit.efficiency.overhead == pytest.approx(7e-6, rel=1e-6)
    assert fit.max_error < 1e-9 and fit.median_error <= fit.max_error
    assert fit.notes == () and fit.device == "h100"


def test_the_fit_recovers_efficiencies_without_overhead() -> None:
    fit = fit_efficiency(measured(seed=4, e=Efficiency(0.7, 0.6, 0.0)), H100)
    assert (fit.efficiency.compute, fit.efficiency.memory) == pytest.approx((0.7, 0.6))
    assert fit.efficiency.overhead == pytest.approx(0.0, abs=1e-12)


def test_the_fit_reports_each_layers_error_and_skips_layers_of_about_zero_seconds() -> None:
    truth = measured()
    rng = np.random.default_rng(7)
    layers = []
    for i, layer in enumerate(truth.layers):
        noise = 1.0 + 0.1 * rng.uniform(-1, 1, size=len(SIZES))
        forward = [t * n for t, n in zip(layer.forward, noise)]
        backward = [t * n for t, n in zip(layer.backward, noise)]
        if i == 3:  # a layer too small to time
            forward, backward = [0.0] * len(SIZES), [0.0] * len(SIZES)
        layers.append(dataclasses.replace(layer, forward=forward, backward=backward))
    noisy = dataclasses.replace(truth, layers=layers)
    fit = fit_efficiency(noisy, H100)
    assert fit.efficiency.compute == pytest.approx(0.43, rel=0.15)
    assert fit.efficiency.memory == pytest.approx(0.81, rel=0.15)
    assert len(fit.layers) == 12 and fit.layers[3].error is None
    errors = [layer.error for layer in fit.layers if layer.error is not None]
    assert len(errors) == 11 and 0 < fit.median_error <= fit.max_error < 0.3
    assert fit.max_error == max(errors) and fit.median_error == pytest.approx(np.median(errors))
    estimate = estimate_profile(noisy, H100, efficiency=fit.efficiency)
    for k, row in enumerate(fit.layers):
        assert row.name == str(k)
        assert row.measured == pytest.approx(
            [f + b for f, b in zip(layers[k].forward, layers[k].backward)]
        )
        expected = [f + b for f, b in zip(estimate.layers[k].forward, estimate.layers[k].backward)]
        assert row.estimated == pytest.approx(expected)
    line = fit.summary()
    assert "\n" not in line and line.startswith("fitted on h100: η_f 0.4")
    assert f"max {fit.max_error:.1%}" in line and "over 11 of 12 layers" in line


def test_a_fit_without_memory_bound_passes_says_so() -> None:
    layers = [counted_layer(i, flops=1e11 * (i + 1), traffic=1e3) for i in range(4)]
    profile = dataclasses.replace(counted_profile(), layers=layers)
    fit = fit_efficiency(
        estimate_profile(profile, H100, efficiency=Efficiency(0.6, 0.7, 2e-6)), H100
    )
    assert fit.efficiency.compute == pytest.approx(0.6) and fit.max_error < 1e-9
    assert fit.notes and "no pass is memory-bound" in fit.notes[0]
    assert fit.notes[0] in fit.summary()


def test_a_fit_of_a_profile_of_zero_times_is_refused() -> None:
    profile = counted_profile()
    layers = [dataclasses.replace(x, forward=[0.0] * 4, backward=[0.0] * 4) for x in profile.layers]
    with pytest.raises(ValueError, match="no layer of the profile measured more than about 0 s"):
        fit_efficiency(dataclasses.replace(profile, layers=layers), H100)


def test_a_fitted_efficiency_estimates_for_another_device() -> None:
    host = measured_device(
        {"peak_flops": {"bfloat16": 1e12}, "memory_bandwidth": 1e11, "memory": 64e9}, key="box"
    )
    on_host = estimate_profile(counted_profile(), host, efficiency=Efficiency(0.9, 0.8, 3e-6))
    fit = fit_efficiency(on_host, host)
    out = estimate_profile(counted_profile(), find_device("mi300x"), efficiency=fit.efficiency)
    assert out.meta["estimate"]["fitted"] is True
    assert out.meta["estimate"]["efficiency"]["compute"] == pytest.approx(0.9)


def test_an_estimated_profile_round_trips_through_json(tmp_path: Path) -> None:
    out = estimate_profile(counted_profile(), H100)
    path = tmp_path / "h100.json"
    out.save(path)
    again = Profile.load(path)
    assert again.meta["estimate"] == out.meta["estimate"]
    assert [x.forward for x in again.layers] == [x.forward for x in out.layers]
    assert [x.flops for x in again.layers] == [x.flops for x in out.layers]
    assert again.device == "h100"


def test_a_plan_of_an_estimated_profile_says_so_and_round_trips(tmp_path: Path) -> None:
    from autopipe.planning.hardware.device_catalog import catalog_devices

    out = estimate_profile(counted_profile(), H100)
    made = plan(out, catalog_devices(H100, 2))
    header = render_header(made)
    line = header.splitlines()[-1]
    assert line == (
        "times estimated for NVIDIA H100 SXM5 80GB (h100) from counted FLOPs and bytes, not "
        "measured (default efficiencies)"
    )
    assert line in render_plan(made)
    path = tmp_path / "plan.json"
    made.save(path)
    loaded = Plan.load(path)
    assert loaded.profile["meta"]["estimate"] == out.meta["estimate"]
    assert render_header(loaded) == header
    fitted = dataclasses.replace(out, meta={"estimate": {**out.meta["estimate"], "fitted": True}})
    assert render_header(plan(fitted, 2)).endswith(
        "not measured (efficiencies fitted to measurements)"
    )


def test_a_plan_of_measured_times_has_no_estimate_line() -> None:
    profile = dataclasses.replace(counted_profile(), meta={})
    assert "estimated" not in render_plan(plan(profile, 2))


def test_a_re_estimate_keeps_where_the_counts_come_from() -> None:
    again = estimate_profile(estimate_profile(counted_profile(), H100), find_device("l40s"))
    assert again.meta["estimate"]["target"] == "l40s"
    assert again.meta["estimate"]["counted_on"] == "meta"


# Peaks and bandwidth of powers of two keep the float8 hand counts exact.
FP8_BOX = measured_device(
    {"peak_flops": {"float8": 4.0, "bfloat16": 2.0}, "memory_bandwidth": 16.0, "memory": 1e9},
    key="fp8-box",
)
EXACT = Efficiency(1.0, 1.0, 0.0)


def test_float8_prices_the_gemms_at_the_fp8_peak_and_attention_at_bfloat16() -> None:
    # A block at one sample: 64 FLOPs forward of which 16 attention, 128 backward (32
    # attention), 64 for the input's gradient; 32 and 64 bytes moved.
    out = estimate_profile(block_profile(2), FP8_BOX, efficiency=EXACT, dtype="float8")
    for layer in out.layers:
        # (64 − 16)/4 + 16/2 = 20 s against 32/16 = 2 s of traffic.
        assert layer.forward == [20.0, 40.0]
        # (128 − 32)/4 + 32/2 = 40 s.
        assert layer.backward == [40.0, 80.0]
        # (64 − 32)/4 + 32/2 = 24 s: attention's backward is input-gradient work.
        assert layer.backward_input == [24.0, 48.0]
    estimate = out.meta["estimate"]
    assert (estimate["dtype"], estimate["peak_flops"]) == ("float8", 4.0)
    assert estimate["attention_peak_flops"] == 2.0 and "note" not in estimate


def test_float8_without_shard_counts_prices_everything_at_fp8_and_says_so() -> None:
    profile = block_profile(2, shards=False)
    out = estimate_profile(profile, FP8_BOX, efficiency=EXACT, dtype="float8")
    assert out.layers[0].forward == [16.0, 32.0]  # 64/4
    note = out.meta["estimate"]["note"]
    assert note.startswith("2 of 2 layers have no shard counts") and "--tp-plan" in note


def test_other_dtypes_record_no_attention_peak() -> None:
    out = estimate_profile(block_profile(2), FP8_BOX, efficiency=EXACT, dtype="bfloat16")
    assert out.layers[0].forward == [32.0, 64.0]  # 64/2
    assert "attention_peak_flops" not in out.meta["estimate"]
