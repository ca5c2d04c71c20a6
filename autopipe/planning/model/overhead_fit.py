"""The runner's fixed seconds per stage and micro-batch, from a timed step of a tiny model.

Both calibrations (:mod:`autopipe.gpipe.executor_calibration`,
:mod:`autopipe.distributed.calibration`) time a step of a tiny model, one layer per stage,
and explain what it takes beyond the work the planner already counts by a fixed cost ``o``
per stage and micro-batch. A step of equal stages lasts a number of stage costs set by the
schedule alone (its *clocks*: ``M + K − 1`` for GPipe's fill and drain, and for 1F1B with
one stage per rank), so each clock carries one ``o``.
"""

from __future__ import annotations

import numpy as np

from autopipe.planning.schedules.schedule_replay import makespans

__all__ = ["overhead_per_clock", "unit_clocks"]


def unit_clocks(ranks: int, chunks: int, schedule: str, virtual_stages: int = 1) -> float:
    """The step, in stage costs, of ``ranks · virtual_stages`` stages of cost 1 each.

    Args:
        ranks: the devices (K); stage ``s`` runs on device ``s mod K``.
        chunks: micro-batches per step (M).
        schedule: ``gpipe``, ``1f1b`` or ``zb``.
        virtual_stages: stages per device (v).
    """
    stages = ranks * virtual_stages
    # A forward of a third and a backward of two thirds, the planner's usual proportion.
    ones = np.ones((1, stages))
    none = np.zeros((1, stages), dtype=np.int64)
    return float(makespans(ones / 3, 2 * ones / 3, 0 * ones, none, ranks, chunks, schedule)[0])


def overhead_per_clock(step: float, work: float, clocks: float) -> float:
    """The fixed seconds per stage and micro-batch that explain ``step``: what it took
    beyond ``work`` (the step the planner predicts without them), spread over ``clocks``;
    never below 0 (a step faster than predicted has no overhead to find)."""
    return max(0.0, (step - work) / clocks)
