"""Measured stage times: each planned stage run alone, repeats interleaved round-robin."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Job", "StageTimer", "Timing", "as_tuple", "summarize"]

# One timed unit of work: units [start, stop) on a micro-batch of ``micro`` samples, either
# forward + backward (``grad=True``) or a no-grad forward (a re-computation's cost).
Job = tuple[int, int, int, bool]


def as_tuple(value: Any) -> tuple[Any, ...]:
    """``value`` itself if it is a tuple, else a 1-tuple: how units pass values on."""
    return value if isinstance(value, tuple) else (value,)


def _run(units: list[nn.Module], args: tuple[Any, ...]) -> tuple[Any, ...]:
    for unit in units:
        args = as_tuple(unit(*args))
    return args


@dataclass(frozen=True)
class Timing:
    """Robust summary of one stage's repeated measurements.

    Attributes:
        median: median seconds per micro-batch.
        q1: first quartile, seconds.
        q3: third quartile, seconds.
        repeats: number of samples behind the quartiles.
        low: the fastest sample, seconds (the least disturbed run; kept for reference).
    """

    median: float
    q1: float
    q3: float
    repeats: int
    low: float

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median (0 for a single sample)."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        """JSON-ready fields, with the relative spread."""
        return {
            "median": self.median,
            "q1": self.q1,
            "q3": self.q3,
            "repeats": self.repeats,
            "low": self.low,
            "spread": self.spread,
        }


def summarize(samples: list[float]) -> Timing:
    """Median and quartiles of ``samples`` (at least one).

    Args:
        samples: seconds, one per repeat.

    Returns:
        The :class:`Timing`; with one sample its quartiles equal the median.
    """
    if not samples:
        raise ValueError("summarize needs at least one sample")
    median = statistics.median(samples)
    if len(samples) < 2:
        return Timing(median, median, median, len(samples), min(samples))
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return Timing(median, q1, q3, len(samples), min(samples))


class StageTimer:
    """Times slices of a unit ``nn.Sequential`` alone on micro-batch inputs.

    Inputs of a slice are the no-grad outputs of the units before it on the first
    ``micro`` samples, computed once and reused. :meth:`run` times a set of jobs in rounds:
    every round runs every job once, so a change in machine load (this machine is shared)
    lands on all stages alike instead of on whichever stage happened to be timed then.
    """

    def __init__(self, seq: nn.Sequential, sample: tuple[Tensor, ...]) -> None:
        self.units = list(seq)
        self.sample = sample
        self._inputs: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.samples: dict[Job, list[float]] = {}

    def _input(self, start: int, micro: int) -> tuple[Any, ...]:
        key = (start, micro)
        if key not in self._inputs:
            with torch.no_grad():
                self._inputs[key] = _run(self.units[:start], tuple(t[:micro] for t in self.sample))
        return self._inputs[key]

    def _once(self, job: Job) -> float:
        start, stop, micro, grad = job
        units = self.units[start:stop]
        args = tuple(
            t.detach().clone().requires_grad_(grad and t.is_floating_point())
            if isinstance(t, Tensor)
            else t
            for t in self._input(start, micro)
        )
        params = [p for u in units for p in u.parameters()]
        for p in params:
            p.grad = None
        begin = time.perf_counter()
        if not grad:
            with torch.no_grad():
                _run(units, args)
            return time.perf_counter() - begin
        outputs = [o for o in _run(units, args) if isinstance(o, Tensor) and o.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        seconds = time.perf_counter() - begin
        for p in params:
            p.grad = None
        return seconds

    def run(self, jobs: Collection[Job], repeats: int) -> None:
        """Times every job ``repeats`` more times, one warm-up each, round-robin.

        Round ``r`` runs the jobs in order, rotated by ``r`` so that no job always follows
        the same one (a stage timed right after a big one finds colder caches). Python's
        garbage collector is paused inside a round, so a collection does not land on one
        stage, and runs between rounds instead.

        Args:
            jobs: distinct ``(start, stop, micro, grad)`` jobs.
            repeats: timed rounds, at least 1.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        order = sorted(set(jobs))
        if not order:
            return
        for job in order:
            self._once(job)  # warm-up: allocator pools, lazy kernels
        enabled = gc.isenabled()
        try:
            for r in range(repeats):
                gc.collect()
                gc.disable()
                shift = r % len(order)
                for job in order[shift:] + order[:shift]:
                    self.samples.setdefault(job, []).append(self._once(job))
                if enabled:
                    gc.enable()
        finally:
            if enabled:
                gc.enable()

    def stage(self, start: int, stop: int, micro: int, recompute: float) -> Timing:
        """A stage's time per micro-batch: forward + backward + ``recompute`` x a forward.

        The two parts are paired by round (both ran within the same round), so each sum is
        one sample of the stage under one machine state, and the spread is the stage's.

        Args:
            start: first unit of the stage.
            stop: one past its last unit.
            micro: micro-batch size.
            recompute: share of micro-batches whose forward the stage re-computes.

        Raises:
            KeyError: the jobs were not :meth:`run`.
        """
        train = self.samples[(start, stop, micro, True)]
        if recompute <= 0:
            return summarize(train)
        forward = self.samples[(start, stop, micro, False)]
        return summarize([t + recompute * f for t, f in zip(train, forward)])
