"""The steps both runners time alike: the benchmark's loss, the turns, the medians."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.microbatching.step_timing import (
    check_steps,
    kept_warmup_rounds,
    mean_output_loss,
    median_seconds,
    take_turns,
    tiny_stages,
    turn_order,
)


def test_mean_output_loss() -> None:
    x = torch.tensor([[1.0, 3.0]])
    assert mean_output_loss(x).item() == 2.0
    assert mean_output_loss((x, torch.tensor([1, 2]), 2 * x)).item() == 6.0
    assert mean_output_loss(x.double()).dtype == torch.float32
    with pytest.raises(ValueError, match="no floating-point tensor"):
        mean_output_loss((torch.tensor([1]),))


def test_the_splits_take_turns_and_the_warmup_is_left_out() -> None:
    calls: list[str] = []
    seen: list[tuple[int, int, str]] = []

    def step(label: str) -> float:
        calls.append(label)
        return float(len(calls))

    times = take_turns(
        ["a", "b"], step, steps=2, warmup=1, progress=lambda *args: seen.append(args)
    )
    assert calls == ["a", "b"] * 3
    assert times == {"a": [3.0, 5.0], "b": [4.0, 6.0]}
    assert seen == [(i, 6, label) for i, label in zip(range(1, 7), calls)]
    check_steps(1, 0)
    with pytest.raises(ValueError, match="at least one timed step"):
        check_steps(0, 1)
    with pytest.raises(ValueError, match="no negative warm-up"):
        check_steps(1, -1)


def test_warm_up_rounds_may_run_their_own_step() -> None:
    warm: list[tuple[str, int]] = []

    def warm_step(label: str, round_: int) -> float:
        warm.append((label, round_))
        return 100.0

    times = take_turns(["a", "b"], lambda label: 1.0, steps=1, warmup=2, warmup_step=warm_step)
    assert warm == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert times == {"a": [1.0], "b": [1.0]}  # the warm-up's seconds are not kept


def test_median_after_the_warmup_and_the_tiny_model() -> None:
    samples = iter([100.0, 3.0, 1.0, 2.0])
    assert median_seconds(lambda: next(samples), repeats=3, warmup=1) == 2.0
    model = tiny_stages(3, 4)
    assert [type(m) for m in model] == [nn.Linear] * 3 and model[0].in_features == 4


@pytest.mark.parametrize(
    ("warmup", "kept"), [(0, []), (1, []), (2, [1]), (3, [1, 2]), (4, [2, 3]), (5, [2, 3, 4])]
)
def test_the_later_half_of_the_warm_up_is_kept(warmup: int, kept: list[int]) -> None:
    assert list(kept_warmup_rounds(warmup)) == kept


@pytest.mark.parametrize(
    ("warmup", "steps", "order"),
    [
        (0, 2, [None, None]),
        (1, 2, [0, None, None]),
        (4, 4, [0, 1, 2, None, None, 3, None, None]),
        (5, 6, [0, 1, 2, None, None, 3, None, None, 4, None, None]),
    ],
)
def test_the_kept_warm_up_rounds_run_among_the_timed_ones(
    warmup: int, steps: int, order: list[int | None]
) -> None:
    assert turn_order(warmup, steps) == order
    rounds: list[int | None] = []
    take_turns(
        ["a"],
        lambda label: rounds.append(None) or 1.0,
        steps=steps,
        warmup=warmup,
        warmup_step=lambda label, round_: rounds.append(round_) or 2.0,
    )
    assert rounds == order
