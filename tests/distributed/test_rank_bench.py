"""Tests of the step benchmark on local ranks (autopipe.distributed.rank_bench)."""

from __future__ import annotations

from typing import Any

import pytest

from autopipe.distributed.rank_bench import time_splits_on_ranks
from autopipe.planning.planner import evaluate
from profiler import profile_model
from tests.support.bench_models import build, failing_build


def _plans(*balances: list[int]) -> dict:
    layers, sample = build()
    profile = profile_model(layers, sample, device="cpu", chunks=2, repeats=1, warmup=0)
    options: dict[str, Any] = {
        "chunks": 2,
        "checkpoint": "never",
        "schedule": "gpipe",
        "optimizer": "sgd",
    }
    return {
        str(balance): evaluate(profile, balance, len(balance), strategy="given", **options)
        for balance in balances
    }


def test_two_ranks_time_every_split() -> None:
    plans = _plans([2, 2], [3, 1])
    seen = []
    result = time_splits_on_ranks(
        build,
        plans,
        ranks=2,
        steps=2,
        warmup=1,
        progress=lambda done, total, label: seen.append((done, total, label)),
    )
    assert set(result) == set(plans)
    for measured in result.values():
        assert len(measured.times) == 2 and all(t > 0 for t in measured.times)
        # Every rank counted its stage's saved activations.
        assert len(measured.saved_peak) == 2
        assert all(isinstance(peak, int) and peak > 0 for peak in measured.saved_peak)
    assert [label for _, _, label in seen] == ["[2, 2]", "[3, 1]"] * 3
    # Stage 0 of [3, 1] saves the inputs of three layers, stage 0 of [2, 2] of two.
    three, two = result["[3, 1]"].saved_peak[0], result["[2, 2]"].saved_peak[0]
    assert three is not None and two is not None and three > two


def test_warm_up_steps_are_timed_in_place() -> None:
    plans = _plans([2, 2], [3, 1])
    result = time_splits_on_ranks(build, plans, ranks=2, steps=1, warmup=3, in_place=True)
    for label, measured in result.items():
        found = measured.in_place
        assert found is not None, label
        # Every stage's forward and backward per micro-batch, from the rank that ran it.
        assert len(found["stages"]) == 2
        for stage in found["stages"]:
            assert stage["forward"] > 0 and stage["backward"] > 0
        assert found["span"] > 0 and found["step"] > 0
    # Without it, nothing is recorded.
    plain = time_splits_on_ranks(build, _plans([2, 2]), ranks=2, steps=1, warmup=2)
    assert plain["[2, 2]"].in_place is None


def test_a_rank_failure_is_one_error() -> None:
    with pytest.raises(RuntimeError, match="rank [01] failed: ValueError: no model here"):
        time_splits_on_ranks(failing_build, _plans([2, 2]), ranks=2, steps=1)


def test_plans_need_one_stage_per_rank() -> None:
    with pytest.raises(ValueError, match="3 stages, not one per rank of 2"):
        time_splits_on_ranks(build, _plans([2, 1, 1]), ranks=2, steps=1)
