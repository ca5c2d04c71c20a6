"""Timed training steps, alike on both runners: the benchmark's loss and turns, and the tiny
model and medians their calibrations time.

The single-process GPipe (:mod:`autopipe.gpipe.split_bench`,
:mod:`autopipe.gpipe.executor_calibration`) and the distributed runner
(:mod:`autopipe.distributed.rank_bench`,
:mod:`autopipe.distributed.calibration`) time their own steps; what a step is, how the
splits take turns and how repeats are summed is the same for both, so that their figures
compare.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "Progress",
    "check_steps",
    "kept_warmup_rounds",
    "mean_output_loss",
    "median_seconds",
    "take_turns",
    "tiny_stages",
    "turn_order",
]

Progress = Callable[[int, int, str], None]


def mean_output_loss(output: Any) -> Tensor:
    """The benchmark's loss: the mean of the output (summed over its floating tensors
    when the model returns several), in float32.

    Raises:
        ValueError: the output holds no floating-point tensor.
    """
    if isinstance(output, Tensor):
        return output.float().mean()
    tensors = [t for t in output if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output holds no floating-point tensor to take a loss of")
    return torch.stack([t.float().mean() for t in tensors]).sum()


def check_steps(steps: int, warmup: int) -> None:
    """Refuses fewer than one timed step or a negative warm-up.

    Raises:
        ValueError: says which.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need at least one timed step and no negative warm-up, got {steps}")


def kept_warmup_rounds(warmup: int) -> range:
    """The warm-up rounds whose steps are recorded for the predictions: the second half.

    The first round sets things up (threads, allocator pools, torch's stages) and the next
    ones still run slower than the timed steps do; so the first half of the warm-up (at
    least its first round) is left out and the rest kept.
    """
    return range(min(max(1, warmup // 2), warmup), warmup)


def turn_order(warmup: int, steps: int) -> list[int | None]:
    """The rounds in the order they run: each warm-up round by its index, each timed round
    as ``None``.

    The first warm-up rounds (those :func:`kept_warmup_rounds` leaves out) run first; the
    kept ones are spread evenly among the timed rounds, so that the steps the predictions
    come from and the steps they are checked against share the machine's slow and quick
    spells (taken all before the timed ones, a drift of the shared host between the two
    spells shows as a prediction error of up to 20%).
    """
    kept = kept_warmup_rounds(warmup)
    first: list[int | None] = list(range(kept.start))
    # The kept rounds at the starts of equal shares of the interleaved span (so one of them
    # leads and the timed steps start as late as before), the timed ones at the middles.
    placed = sorted(
        [(j / len(kept), 0, kept[j]) for j in range(len(kept))]
        + [((j + 0.5) / steps, 1, None) for j in range(steps)],
        key=lambda item: (item[0], item[1]),
    )
    return first + [round_ for _, _, round_ in placed]


def take_turns(
    labels: Sequence[str],
    step: Callable[[str], float],
    *,
    steps: int,
    warmup: int,
    progress: Progress | None = None,
    warmup_step: Callable[[str, int], float] | None = None,
) -> dict[str, list[float]]:
    """Runs ``warmup + steps`` rounds of one step per label, so that a slow spell of the
    machine touches every split alike, in :func:`turn_order`.

    Args:
        labels: the splits, in the order they take their turns.
        step: runs one step of a split and returns its seconds.
        steps: timed rounds.
        warmup: untimed rounds: the first ones first, the later ones among the timed.
        progress: called with (steps done, steps in all, label) after every step.
        warmup_step: runs a warm-up step instead of ``step``, given the label and the
            warm-up round (from 0), e.g. to record the later ones.

    Returns:
        Per label, the seconds of its timed steps.
    """
    times: dict[str, list[float]] = {label: [] for label in labels}
    total, done = (warmup + steps) * len(labels), 0
    for round_ in turn_order(warmup, steps):
        for label in labels:
            if round_ is None:
                times[label].append(step(label))
            elif warmup_step is not None:
                warmup_step(label, round_)
            else:
                step(label)
            done += 1
            if progress is not None:
                progress(done, total, label)
    return times


def tiny_stages(stages: int, width: int) -> nn.Sequential:
    """The calibrations' model: one ``Linear(width, width)`` per stage, whose compute is
    small next to the runner's own cost per stage and micro-batch."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(stages)])


def median_seconds(timed: Callable[[], float], repeats: int, warmup: int) -> float:
    """The median seconds of ``repeats`` calls of ``timed`` after ``warmup`` untimed ones.

    Args:
        timed: runs the measured work once and returns its seconds.
        repeats: the calls kept (at least one).
        warmup: the calls first left out.
    """
    samples = [timed() for _ in range(warmup + repeats)]
    return statistics.median(samples[warmup:])
