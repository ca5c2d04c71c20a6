"""V-shaped schedules: torch's ZBV zero bubble and DualPipeV, their placement and order.

With K ranks the model is cut into 2K contiguous stages and rank r holds stages r and
2K−1−r: the first on the way down, the second on the way back, so rank 0 holds the first
stage (the embedding) and the last (the head), and the last stage's output turns around on
the rank that computed it. Each backward is split into its input part (``"I"``, sent on)
and its weight part (``"W"``, deferred to fill idle time).

:func:`v_order` gives a rank's operations in the order torch 2.13 runs them
(``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``'s ``_calculate_single_rank_operations``),
its no-op slots left out. Assumptions:

- ZBV with fewer than 2K−1 micro-batches: torch plans 2K−1 and drops the missing ones; so
  does this order.
- DualPipeV runs some backwards whole (``"B"``: input and weights at once) and pairs a
  forward with a backward of the other stage as one overlapped action (all of its steady
  phase but the last rank's first pair, which torch runs apart to shorten the bubble). The
  order lists each pair's forward and then its backward, back to back, and
  :func:`v_pairs` says where the pairs are: the replay lets each half's all-to-alls hide
  behind the other half's compute there
  (:mod:`autopipe.planning.schedules.schedule_replay`).
"""

from __future__ import annotations

import functools

__all__: list[str] = []

# One operation of a rank: (op, stage, micro-batch); op in F, B, I, W.
Action = tuple[str, int, int]


def v_stages(rank: int, ranks: int) -> list[int]:
    """The two stages rank ``rank`` of ``ranks`` holds: ``[r, 2K−1−r]``."""
    return [rank, 2 * ranks - 1 - rank]


def v_rank(stage: int, ranks: int) -> int:
    """The rank that holds ``stage`` of ``2·ranks`` in the V placement."""
    return stage if stage < ranks else 2 * ranks - 1 - stage


def _zbv_order(rank: int, ranks: int, chunks: int) -> list[Action]:
    """ScheduleZBVZeroBubble's order for one rank."""
    n = max(2 * ranks - 1, chunks)
    s0, s1 = rank, 2 * ranks - 1 - rank
    count = {(op, s): 0 for op in "FIW" for s in (s0, s1)}
    order: list[Action] = []

    def add(op: str, stage: int, micro_batch: int | None = None) -> None:
        key = (op, stage)
        if micro_batch is None:
            micro_batch = count[key]
            count[key] += 1
        order.append((op, stage, micro_batch))

    for _ in range(2 * (ranks - rank) - 1):
        add("F", s0)
    for _ in range(rank):
        add("F", s1)
        add("F", s0)
    for _ in range(ranks - rank):
        add("F", s1)
        add("I", s1)
        add("W", s1)
    while count["F", s1] < count["F", s0] or count["F", s0] < n:
        if count["F", s0] < n:
            add("F", s0)
        add("I", s0)
        add("W", s0)
        add("F", s1)
        add("I", s1)
        add("W", s1)
    # Cool-down: weights lag behind their inputs' gradients, then drain.
    w0, w1 = count["I", s0], count["I", s1]
    for _ in range(rank):
        add("I", s0)
        add("I", s1)
    for _ in range(ranks - rank):
        add("I", s0)
        add("W", s0, w0)
        w0 += 1
    order += [("W", s1, i) for i in range(w1, count["I", s1])]
    order += [("W", s0, i) for i in range(w0, count["I", s0])]
    return [a for a in order if a[2] < chunks]


def _dualpipev_order(rank: int, ranks: int, chunks: int) -> list[Action]:
    """ScheduleDualPipeV's order for one rank, each overlapped pair as F then B."""
    return list(_dualpipev_plan(rank, ranks, chunks)[0])


@functools.lru_cache(maxsize=256)
def _dualpipev_plan(
    rank: int, ranks: int, chunks: int
) -> tuple[tuple[Action, ...], frozenset[int]]:
    """ScheduleDualPipeV's order for one rank and the positions of its pairs' forwards."""
    if chunks < 2 * ranks:
        raise ValueError(
            f"dualpipev needs at least as many micro-batches as stages ({2 * ranks}), "
            f"got {chunks}; raise chunks or use zbv"
        )
    s0, s1 = rank, 2 * ranks - 1 - rank
    count = {(op, s): 0 for op in "FI" for s in (s0, s1)}
    queue: list[tuple[int, int]] = []  # input gradients whose weights' gradients wait
    order: list[Action] = []
    pairs: set[int] = set()

    def add(op: str, stage: int) -> None:
        key = ("F" if op == "F" else "I", stage)
        order.append((op, stage, count[key]))
        if op == "I":
            queue.append((stage, count[key]))
        count[key] += 1

    def weight() -> None:
        if queue:
            stage, micro_batch = queue.pop(0)
            order.append(("W", stage, micro_batch))

    for _ in range(2 * (ranks - rank - 1)):
        add("F", s0)
    for _ in range(rank + 1):
        add("F", s0)
        add("F", s1)
    for _ in range(ranks - rank - 1):
        add("I", s1)
        weight()
        add("F", s1)

    def pair(forward: int, backward: int) -> None:
        pairs.add(len(order))
        add("F", forward)
        add("B", backward)

    for i in range(chunks - 2 * ranks + rank + 1):
        # The overlapped pairs F0·B1 and F1·B0, halves in turn; the last rank runs its
        # first F0 and B1 apart (torch: so as to shorten the bubble).
        if i == 0 and rank == ranks - 1:
            add("F", s0)
            add("B", s1)
        else:
            pair(s0, s1)
        pair(s1, s0)
    for _ in range(ranks - rank - 1):
        add("B", s1)
        pair(s1, s0)
    steps, split = rank + 1, False
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            split = True
        add("I" if split else "B", s1)
        if i == steps // 2 and rank % 2 == 0:
            split = True
        add("I" if split else "B", s0)
    for _ in range(ranks - rank - 1):
        weight()
        add("I" if split else "B", s0)
    for _ in range(rank + 1):
        weight()
    return tuple(order), frozenset(pairs)


def v_order(rank: int, ranks: int, chunks: int, schedule: str) -> list[Action]:
    """The operations rank ``rank`` runs in one step of a V schedule, in torch's order.

    Args:
        rank: the rank, from 0.
        ranks: K (2K stages).
        chunks: M, micro-batches.
        schedule: ``zbv`` or ``dualpipev``.

    Raises:
        ValueError: an unknown schedule, or dualpipev with fewer than 2K micro-batches.
    """
    if schedule == "zbv":
        return _zbv_order(rank, ranks, chunks)
    if schedule == "dualpipev":
        return _dualpipev_order(rank, ranks, chunks)
    raise ValueError(f"unknown V schedule {schedule!r}: choose zbv or dualpipev")


def v_pairs(rank: int, ranks: int, chunks: int, schedule: str) -> frozenset[int]:
    """Where in :func:`v_order` rank ``rank`` runs an overlapped pair: the positions of
    the pairs' forwards, each followed by its backward (none under ``zbv``).

    Raises:
        ValueError: as :func:`v_order`.
    """
    if schedule == "dualpipev":
        return _dualpipev_plan(rank, ranks, chunks)[1]
    v_order(rank, ranks, chunks, schedule)  # the same refusals
    return frozenset()
