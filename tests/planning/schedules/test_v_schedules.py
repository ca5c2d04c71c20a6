"""The V schedules' orders against torch's own, and their placement."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from autopipe.planning.schedules.v_schedules import v_order, v_rank, v_stages

_CLASSES = {
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
    "dualpipev": torch_schedules.ScheduleDualPipeV,
}


def _torch_order(schedule: str, rank: int, ranks: int, chunks: int) -> list[tuple[str, int, int]]:
    """torch's per-rank action list, computed without stages or a process group: the
    order's own method on an object carrying only the figures it reads."""
    fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=chunks, num_stages=2 * ranks)
    actions = _CLASSES[schedule]._calculate_single_rank_operations(fake, rank)
    out = []
    for action in actions:
        if action is None:
            continue
        for part in action.sub_actions or (action,):  # an overlapped pair: F, then B
            out.append((part.computation_type.value, part.stage_index, part.microbatch_index))
    return out


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [2, 4, 7, 8, 12])
def test_order_equals_torchs(schedule: str, ranks: int, chunks: int) -> None:
    if schedule == "dualpipev" and chunks < 2 * ranks:
        with pytest.raises(ValueError, match="at least as many micro-batches"):
            v_order(0, ranks, chunks, schedule)
        return
    for rank in range(ranks):
        assert v_order(rank, ranks, chunks, schedule) == _torch_order(schedule, rank, ranks, chunks)


def test_placement_matches_torchs_v_style() -> None:
    for ranks in (1, 2, 3, 5):
        mapping = torch_schedules.generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v")
        assert [v_rank(s, ranks) for s in range(2 * ranks)] == [
            mapping[s] for s in range(2 * ranks)
        ]
        for r in range(ranks):
            assert all(v_rank(s, ranks) == r for s in v_stages(r, ranks))
