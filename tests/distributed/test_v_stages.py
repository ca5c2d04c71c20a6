"""V-shaped placement: rank r holds stages r and 2K−1−r; torch's constraints refused early."""

from __future__ import annotations

import pytest

from autopipe.distributed.v_stages import (
    V_SCHEDULES,
    check_v_sizes,
    is_v_schedule,
    v_stage_indices,
    v_stage_rank,
    v_stage_ranks,
)


def test_v_placement() -> None:
    assert [v_stage_indices(r, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [v_stage_indices(r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v_stage_ranks(2) == [0, 1, 1, 0]
    assert all(v_stage_rank(s, 4) == r for r in range(4) for s in v_stage_indices(r, 4))
    # The first and the last stage share rank 0: inputs and targets are read there.
    assert v_stage_rank(0, 3) == v_stage_rank(5, 3) == 0
    with pytest.raises(ValueError, match="not a rank"):
        v_stage_indices(2, 2)
    with pytest.raises(ValueError, match="not one of the 4 stages"):
        v_stage_rank(4, 2)


def test_v_schedules_are_torch_s() -> None:
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble

    assert {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV} == V_SCHEDULES
    assert is_v_schedule("zbv") and is_v_schedule("dualpipev")
    assert not is_v_schedule("1f1b") and not is_v_schedule(None)


def test_v_size_checks() -> None:
    check_v_sizes("zbv", 2, 8, 4)
    check_v_sizes("dualpipev", 4, 8, 8, [1] * 8, virtual_stages=2)
    with pytest.raises(ValueError, match="chunks=3 for 2K = 4 stages"):
        check_v_sizes("dualpipev", 2, 8, 3)
    with pytest.raises(ValueError, match="chunks >= 8"):
        check_v_sizes("zbv", 4, 8, 4)
    with pytest.raises(ValueError, match="balance has 2 entries; give 4"):
        check_v_sizes("zbv", 2, 8, 4, [4, 4])
    with pytest.raises(ValueError, match="split the model's 8 layers"):
        check_v_sizes("zbv", 2, 8, 4, [2, 2, 2, 1])
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        check_v_sizes("zbv", 2, 3, 4)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        check_v_sizes("zbv", 2, 8, 4, virtual_stages=3)
    with pytest.raises(ValueError, match="data_parallel=2"):
        check_v_sizes("zbv", 2, 8, 4, data_parallel=2)
    with pytest.raises(ValueError, match="not a V schedule"):
        check_v_sizes("1f1b", 2, 8, 4)
