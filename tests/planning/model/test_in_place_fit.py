"""Per-layer factors fitted on stages timed in place (autopipe.planning.model.in_place_fit)."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.planning.model.in_place_fit import (
    StageSeconds,
    fit_layer_scales,
    fit_update,
    scaled_profile,
    uniform_scales,
)
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import evaluate, plan
from tests.support.planning_cases import linear_profile, random_profile


def _timed(truth: dict[str, np.ndarray], found: Plan, profile) -> StageSeconds:
    """What each stage of ``found`` would measure if every layer's times were ``truth``
    times the profile's: the prediction of the profile scaled by ``truth``."""
    real = evaluate(
        scaled_profile(profile, truth, "truth"),
        found.balance,
        len(found.balance),
        checkpoint=found.checkpoint,
        chunks=found.chunks,
        optimizer="sgd",
    )
    return StageSeconds(
        found, [s.forward for s in real.stages], [s.compute - s.forward for s in real.stages]
    )


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("seed", range(8))
def test_the_fit_reproduces_every_measured_stage(seed: int, checkpoint: str) -> None:
    rng = np.random.default_rng(seed)
    n, k = 12, 3
    profile = random_profile(rng, n)
    # The truth: one factor per run of layers no split cuts, forward and backward apart.
    balances = [[4, 4, 4], [2, 5, 5], [6, 3, 3]]
    plans = [
        evaluate(profile, b, k, checkpoint=checkpoint, chunks=4, optimizer="sgd") for b in balances
    ]
    cuts = sorted({0, n, *(s.start for p in plans for s in p.stages)})
    segment = rng.uniform(0.5, 3.0, (2, len(cuts) - 1))
    truth = {
        "forward": np.repeat(segment[0], np.diff(cuts)),
        "backward": np.repeat(segment[1], np.diff(cuts)),
    }
    observed = [_timed(truth, p, profile) for p in plans]
    found = fit_layer_scales(profile, observed)
    np.testing.assert_allclose(found["forward"], truth["forward"], rtol=1e-9)
    np.testing.assert_allclose(found["backward"], truth["backward"], rtol=1e-9)
    # Every split, measured or not, is then predicted as the truth would run it.
    fitted = scaled_profile(profile, found, "fit")
    real = scaled_profile(profile, truth, "truth")
    for balance in ([3, 4, 5], [5, 5, 2], *balances):
        a = evaluate(fitted, balance, k, checkpoint=checkpoint, chunks=4, optimizer="sgd")
        b = evaluate(real, balance, k, checkpoint=checkpoint, chunks=4, optimizer="sgd")
        assert a.step_time == pytest.approx(b.step_time, rel=1e-9)


def test_one_split_gives_one_factor_per_stage() -> None:
    profile = linear_profile([1.0, 2.0, 3.0, 4.0])
    found = plan(profile, 2, chunks=1, checkpoint="never", optimizer="sgd")
    assert found.balance == [3, 1]
    # Stage 0 ran twice as slow as predicted, stage 1 as predicted.
    observed = StageSeconds(
        found,
        [2 * found.stages[0].forward, found.stages[1].forward],
        [
            2 * (s.compute - s.forward) if s.index == 0 else s.compute - s.forward
            for s in found.stages
        ],
    )
    scales = fit_layer_scales(profile, [observed])
    assert list(scales["forward"]) == pytest.approx([2, 2, 2, 1])
    assert list(scales["backward"]) == pytest.approx([2, 2, 2, 1])
    # Planned again from them, the split moves off the slow layers.
    again = plan(
        scaled_profile(profile, scales, "test"), 2, chunks=1, checkpoint="never", optimizer="sgd"
    )
    assert again.balance == [2, 2]


def test_factors_multiply_the_profiles_own() -> None:
    profile = linear_profile([1.0, 2.0])
    once = scaled_profile(profile, uniform_scales(profile, 2.0), "first")
    twice = scaled_profile(once, uniform_scales(profile, 3.0), "second")
    assert list(ProfileLines.from_profile(twice).layer_scale["forward"]) == [6.0, 6.0]
    assert twice.meta["calibration"]["layer_scales_source"] == "second"
    assert "calibration" not in profile.meta or "layer_scales" not in profile.meta["calibration"]
    step = evaluate(twice, [1, 1], 2, chunks=1, optimizer="sgd").step_time
    assert step == pytest.approx(
        6 * evaluate(profile, [1, 1], 2, chunks=1, optimizer="sgd").step_time
    )


def test_bad_factors_are_refused() -> None:
    profile = linear_profile([1.0, 2.0])
    profile.meta["calibration"] = {"layer_scales": {"forward": [1.0], "backward": [1.0, 1.0]}}
    with pytest.raises(ValueError, match="one positive factor per layer"):
        ProfileLines.from_profile(profile)
    with pytest.raises(ValueError, match="positive"):
        uniform_scales(profile, 0.0)
    with pytest.raises(ValueError, match="no timed stages"):
        fit_layer_scales(profile, [])


def test_the_optimizers_step_follows_the_stage_with_the_most_parameters() -> None:
    profile = linear_profile([1.0, 1.0, 1.0, 1.0], params=[100, 300, 200, 400])
    update = 0.01  # seconds per parameter byte
    timed = scaled_profile(profile, uniform_scales(profile, 1.0), "test", update)
    for balance in ([1, 3], [2, 2], [3, 1]):
        plain = evaluate(profile, balance, 2, chunks=2, optimizer="sgd")
        found = evaluate(timed, balance, 2, chunks=2, optimizer="sgd")
        sizes = [sum([100, 300, 200, 400][s.start : s.stop]) for s in found.stages]
        assert [s.update for s in found.stages] == pytest.approx([update * b for b in sizes])
        assert found.step_time == pytest.approx(plain.step_time + update * max(sizes))
    # The planner weighs it: its step is the least of every split's.
    best = min(
        ([1, 3], [2, 2], [3, 1]),
        key=lambda b: evaluate(timed, b, 2, chunks=2, optimizer="sgd").step_time,
    )
    assert plan(timed, 2, chunks=2, optimizer="sgd").step_time == pytest.approx(
        evaluate(timed, best, 2, chunks=2, optimizer="sgd").step_time
    )
    # Stages taking turns on one device run their steps one after another.
    shared = evaluate(timed, [2, 2], ["cpu", "cpu"], chunks=2, optimizer="sgd", colocated=True)
    alone = evaluate(profile, [2, 2], ["cpu", "cpu"], chunks=2, optimizer="sgd", colocated=True)
    assert shared.step_time == pytest.approx(alone.step_time + update * 1000)


def test_fit_update_is_the_line_through_the_origin() -> None:
    assert fit_update([(100.0, 1.0), (200.0, 2.0)]) == pytest.approx(0.01)
    assert fit_update([(0.0, 1.0)]) == 0.0
    assert fit_update([]) == 0.0
