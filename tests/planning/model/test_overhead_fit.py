"""The runner's fixed cost per clock, from a timed step of equal stages."""

from __future__ import annotations

import pytest

from autopipe.planning.model.overhead_fit import overhead_per_clock, unit_clocks


@pytest.mark.parametrize(("ranks", "chunks"), [(1, 1), (2, 8), (4, 3)])
def test_equal_stages_take_fill_and_drain_clocks(ranks: int, chunks: int) -> None:
    # Thirds do not sum exactly in binary: the replay's clocks are M + K − 1 to rounding.
    for schedule in ("gpipe", "1f1b"):
        assert unit_clocks(ranks, chunks, schedule) == pytest.approx(chunks + ranks - 1, 1e-12)
    # Two stages per rank interleave: each rank runs 2·M stage costs, plus the fill.
    assert unit_clocks(2, 4, "1f1b", virtual_stages=2) == pytest.approx(2 * 4 + 2 - 1, 1e-12)


def test_the_overhead_is_what_the_step_takes_beyond_its_work_per_clock() -> None:
    assert overhead_per_clock(step=13.0, work=4.0, clocks=9.0) == 1.0
    assert overhead_per_clock(step=3.0, work=4.0, clocks=9.0) == 0.0  # faster than predicted
