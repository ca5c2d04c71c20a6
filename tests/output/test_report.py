"""Tests of the plain-text plan report (autopipe.output.report)."""

from __future__ import annotations

import pytest

from autopipe.output.report import (
    bar,
    format_rate,
    layer_range,
    precision_label,
    render_comparison,
    render_header,
    render_plan,
    render_stages,
    render_summary,
)
from autopipe.planning.model.quantities import format_time
from autopipe.planning.planner import evaluate, plan
from profiler.profile import LayerProfile, Profile
from tests.support.planning_cases import linear_profile

COSTS = [1.0, 1.0, 6.0, 6.0, 1.0, 1.0, 1.0, 1.0]


def make_profile(names: list[str] | None = None) -> Profile:
    layers = [
        LayerProfile(
            name=names[i] if names else str(i),
            kind="Linear" if i % 2 == 0 else "ReLU",
            forward=[1e-3 * c, 2e-3 * c],
            backward=[2e-3 * c, 4e-3 * c],
            saved=[1000, 2000],
            output=[4000, 8000],
            param_bytes=10_000 * (i + 1),
        )
        for i, c in enumerate(COSTS)
    ]
    return Profile(
        layers=layers,
        batch_sizes=[2, 4],
        input=[4000, 8000],
        batch_size=16,
        chunks=4,
        device="cpu",
        device_name="Test CPU",
    )


NAMES = ["embed", "act0", "wide1", "wide2", "fc3", "act3", "fc4", "head"]


def test_bar() -> None:
    assert bar(0.5, 10) == "#####....."
    assert bar(1.0, 4) == "####"
    assert bar(0.0, 4) == "...."
    assert bar(2.0, 4) == "####" and bar(-1.0, 4) == "...."
    assert len(bar(0.33)) == 20


def test_layer_range_with_names() -> None:
    result = plan(make_profile(NAMES), 2)
    first, second = result.stages
    assert layer_range(first) == f"0-{first.stop - 1}  (embed..{NAMES[first.stop - 1]})"
    assert layer_range(second).endswith(f"({NAMES[second.start]}..head)")
    single = evaluate(make_profile(NAMES), [1, 7]).stages[0]
    assert layer_range(single) == "0  (embed)"
    assert layer_range(single, width=3) == "0    (embed)"


def test_positional_names_show_kinds() -> None:
    text = render_stages(evaluate(make_profile(), [4, 4]))
    assert "0-3  (Linear..ReLU)" in text
    assert "4-7  (Linear..ReLU)" in text


def test_stage_table() -> None:
    result = plan(make_profile(NAMES), 3)
    lines = render_stages(result).splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "layers"]
    assert len(lines) == 1 + 3
    bottleneck = lines[1 + result.bottleneck_stage]
    assert "100.0%" in bottleneck and "#" * 20 in bottleneck
    assert "of which send" not in lines[0]
    assert " / " not in "\n".join(lines)  # no capacity given


def test_capacity_and_send_columns() -> None:
    result = plan(make_profile(NAMES), 2, memory="1MiB", bandwidth=1e6)
    text = render_stages(result)
    assert "of which send" in text.splitlines()[0]
    assert "/ 1.00 MiB (" in text


def test_summary() -> None:
    result = plan(make_profile(NAMES), 2)
    text = render_summary(result)
    assert f"balance     {result.balance}" in text
    assert f"stage {result.bottleneck_stage}," in text
    assert "per mini-batch (4 micro-batches)" in text
    assert f"{result.bubble:.1%} of the step idle" in text
    assert f"{result.efficiency:.1%} of the pipeline busy" in text


def test_header() -> None:
    text = render_header(plan(make_profile(NAMES), 2))
    assert "8 layers on 2 stages [cpu (Test CPU)], batch 16 as 4 micro-batches of 4" in text
    assert "strategy optimal, schedule gpipe, checkpoint except_last, optimizer adam" in text


@pytest.mark.parametrize(
    ("dtype", "autocast", "expected"),
    [
        ("float32", None, ""),
        ("float32", "bfloat16", "autocast bfloat16"),
        ("bfloat16", None, "dtype bfloat16"),
        ("float16", "float16", "dtype float16, autocast float16"),
    ],
)
def test_header_names_the_precision(dtype: str, autocast: str | None, expected: str) -> None:
    profile = make_profile()
    profile.dtype, profile.autocast = dtype, autocast
    assert precision_label(profile.to_dict()) == expected
    second = render_header(plan(profile, 2)).splitlines()[1]
    assert second.endswith(f"optimizer adam, {expected}" if expected else "optimizer adam")


def test_comparison_faster() -> None:
    profile = make_profile(NAMES)
    best = plan(profile, 2)
    uniform = plan(profile, 2, strategy="uniform")
    assert best.balance != uniform.balance
    line = render_comparison(best, uniform)
    ratio = uniform.step_time / best.step_time
    assert line.startswith(f"uniform {uniform.balance}: step ")
    assert ", bottleneck " in line
    assert line.endswith(f"— optimal is {ratio:.2f}x faster")
    assert ratio > 1.1
    # The other way round it is slower.
    assert render_comparison(uniform, best).endswith(f"— uniform is {ratio:.2f}x slower")


def test_comparison_same_split_and_message() -> None:
    profile = make_profile(NAMES)
    best = plan(profile, 2)
    assert render_comparison(best, best).endswith("the same split as optimal")
    line = render_comparison(best, "the uniform split [4, 4] does not fit", "uniform")
    assert line == "vs uniform: the uniform split [4, 4] does not fit"


def test_comparison_within_tolerance_is_a_tie() -> None:
    # Two splits whose step times differ by 0.1%: neither "1.00x faster" nor "slower".
    costs = [1.0, 1.0, 0.001, 1.0, 1.0005]
    layers = [
        LayerProfile(
            name=str(i),
            kind="Linear",
            forward=[1e-3 * c, 2e-3 * c],
            backward=[2e-3 * c, 4e-3 * c],
            saved=[0, 0],
            output=[0, 0],
        )
        for i, c in enumerate(costs)
    ]
    profile = Profile(layers=layers, batch_sizes=[2, 4], input=[0, 0], batch_size=16, chunks=4)
    first, second = evaluate(profile, [3, 2]), evaluate(profile, [2, 3])
    assert first.step_time != second.step_time
    assert abs(second.step_time / first.step_time - 1) < 0.005
    assert render_comparison(first, second).endswith(f"— as fast as {first.strategy}")
    assert render_comparison(second, first).endswith(f"— as fast as {second.strategy}")


@pytest.mark.parametrize(
    ("rate", "text"),
    [
        (0.5, "0.5 samples/s"),
        (12.34, "12.3 samples/s"),
        (999.4, "999 samples/s"),
        (999.6, "1k samples/s"),
        (1031.0, "1.03k samples/s"),
        (999_600.0, "1M samples/s"),
        (2.5e9, "2.5G samples/s"),
        (1.234e12, "1234G samples/s"),
    ],
)
def test_format_rate_has_no_exponent(rate: float, text: str) -> None:
    assert format_rate(rate) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (999.6e-6, "1 ms"),
        (17.24e-3, "17.2 ms"),
        (0.9996, "1 s"),
        (1234.5, "1234 s"),
        (0.5e-6, "0.5 µs"),
    ],
)
def test_format_time_has_no_exponent(seconds: float, text: str) -> None:
    assert format_time(seconds) == text


@pytest.mark.parametrize("baseline", [None, "uniform does not fit"])
def test_render_plan(baseline: str | None) -> None:
    result = plan(make_profile(NAMES), 2)
    text = render_plan(result, baseline)
    assert text.endswith("\n")
    assert render_stages(result) in text and render_summary(result) in text
    assert ("vs uniform" in text) == (baseline is not None)


def test_plan_without_profile_data() -> None:
    result = plan(make_profile(NAMES), 2)
    result.profile = {}
    text = render_plan(result)
    assert "8 layers on 2 stages [cpu], 4 micro-batches of 4" in text
    assert "(embed.." in text


def test_auto_plans_name_each_stages_recomputed_units() -> None:
    profile = linear_profile(
        [1.0, 2.0, 3.0, 4.0], saved=[100] * 4, output=[10] * 4, batch=8, chunks=4, input_bytes=10
    )
    found = plan(profile, 1, chunks=4, checkpoint="auto", memory=1200)
    text = render_stages(found)
    assert "units 2 of 4 (l0, l1)" in text
    assert "checkpoint auto (1 of 1 stages checkpoint)" in render_header(found)
