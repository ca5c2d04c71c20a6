"""Relative tolerances of the split solvers and the search, named by what they decide."""

from __future__ import annotations

__all__ = []

# Two step times (or a time and a cap) this close, relative to their size, are the same:
# the sums behind them add the same layer figures in another order and differ by rounding.
SAME_TIME = 1e-9
# A move of a local search must shorten the step by more than this share to be taken.
IMPROVEMENT = 1e-12

# Bisections on a bottleneck stop when their bracket is this tight relative to it.
# The min-max partition: stage sums closer than this are indistinguishable in float64 prefix
# sums anyway.
BISECT_MINMAX = 1e-12
# The relaxed partition's probes (:mod:`autopipe.planning.split.screening`).
BISECT_RELAXED = 1e-11
# The interval solver's passes (:mod:`autopipe.planning.split.intervals`).
BISECT_INTERVALS = 1e-10
