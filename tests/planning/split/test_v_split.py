"""The split of a V placement's 2K stages (zbv, dualpipev): the replayed optimum under
each rank's memory (both of its stages together), against every split."""

from __future__ import annotations

import pytest

from autopipe.planning.model.spans import overflows, stage_memory
from autopipe.planning.planner import interleaved_balance
from tests.support.planning_references import check_replayed_split, random_model


@pytest.mark.parametrize(
    ("schedule", "ranks", "chunks"), [("zbv", 2, 4), ("zbv", 3, 5), ("dualpipev", 2, 4)]
)
@pytest.mark.parametrize("share", [None, 0.6])
def test_v_split_is_the_fastest_split_that_fits(
    schedule: str, ranks: int, chunks: int, share: float | None
) -> None:
    checked = 0
    for seed in range(4):
        model = random_model(
            seed,
            layers=10 if ranks == 2 else 8,
            stages=2 * ranks,
            chunks=chunks,
            schedule=schedule,
            capacity_share=share,
            virtual_stages=2,
        )
        checked += check_replayed_split(model)
    assert checked


def test_a_rank_holds_its_two_v_stages_memory() -> None:
    # Rank 0 holds stages 0 and 3: the memory check sums those two, not 0 and 2.
    model = random_model(0, layers=8, stages=4, schedule="zbv", virtual_stages=2)
    assert model.placement == [0, 1, 1, 0]
    memory = stage_memory(model, [2, 2, 2, 2])
    _, ranks = overflows(model, memory[None, :])
    capacity = model.capacity(0)
    assert ranks[0].tolist() == pytest.approx(
        [memory[0] + memory[3] - capacity, memory[1] + memory[2] - model.capacity(1)]
    )


def test_planner_gives_a_v_split() -> None:
    model = random_model(1, layers=9, stages=4, schedule="zbv", virtual_stages=2, chunks=4)
    balance = interleaved_balance(model)
    assert sum(balance) == 9 and len(balance) == 4
