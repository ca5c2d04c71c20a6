"""torchgpipe's balancer: its Bárány–Grinberg block partition, step for step (for comparison)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopipe import PlanningError

__all__: list[str] = []

# torchgpipe's loop has no bound of its own. The moves that end take far fewer than this
# many per layer and stage on every sequence measured (zero-free ones, at most a few); a run
# past it is one whose splits drifted out of the sequence (zero costs tie an empty block
# with a minimal one), which does not come back.
_MOVES_PER_CELL = 64


def blockpartition(costs: Sequence[float], stages: int) -> list[int]:
    """The balance torchgpipe 0.0.7's ``torchgpipe.balance.blockpartition.solve`` returns.

    ``solve`` follows I. Bárány and V. S. Grinberg, "Block partitions of sequences"
    (arXiv:1308.2452): normalize the costs into ``[0, 1]``, start from an equal-count split
    and move elements toward a minimal block until the largest block sum ``M`` is at most
    the smallest ``m`` plus 1. This function repeats its arithmetic and its choices
    exactly, so that a comparison against torchgpipe compares against what its users get:

    - the start: the first ``k - 1`` blocks get ``n // k`` elements, the last the rest
      (``[1] * 7`` into 3 starts as ``[2, 2, 3]``);
    - block sums are ``sum()`` over the normalized slice, in order (the same floats);
    - the maximal block ``p`` is the last of the largest sums, the minimal ``q`` the first
      of the smallest (Python's ``max``/``min`` of ``(sum, index)`` pairs), and ``M`` is the
      value taken when ``p`` was chosen, kept until ``p`` itself gives up an element.

    The heuristic minimizes the spread of block sums, not their maximum, so it is not
    optimal for pipelines: on ``[5] * 7 + [20]`` with 2 stages the normalized sequence is
    ``[0] * 7 + [1]``, the equal split already passes the stop test, and it returns
    ``[4, 4]`` (max stage 35) where ``[6, 2]`` gives 30.

    Args:
        costs: non-negative, finite cost of each layer, in order: the sequence torchgpipe
            hands ``solve`` (``balance_by_time`` gives integer microseconds per layer).
        stages: number of blocks ``k``, ``1 <= k <= len(costs)``.

    Returns:
        The number of layers in each stage: ``k`` integers, each at least 1, summing to
        ``len(costs)``.

    Raises:
        ValueError: ``stages`` is out of range, or a cost is negative or not finite.
        PlanningError: torchgpipe gives no usable split on these costs: it never stops (its
            moves cycle, which zero costs can cause) or it leaves a stage empty (which its
            own ``GPipe`` refuses).
    """
    values = list(costs)
    _check(values, stages)
    n, k = len(values), stages
    lowest = min(values)
    span = max(values) - lowest
    normal = [0.0] * n if span == 0 else [(v - lowest) / span for v in values]

    # splits[j] is where block j ends; block j is normal[splits[j - 1]:splits[j]]. As in
    # torchgpipe the slices are Python's: a move may make one end before it starts.
    splits = [n // k * (j + 1) for j in range(k - 1)] + [n]
    sums = [_block_sum(normal, splits, j) for j in range(k)]
    seen: set[tuple[int, ...]] = set()
    limit = _MOVES_PER_CELL * n * k
    while True:
        high, p = max((s, j) for j, s in enumerate(sums))
        while True:
            low, q = min((s, j) for j, s in enumerate(sums))
            if high <= low + 1:
                return _counts(splits, values)
            # What follows depends on the splits and p alone (the M compared with is p's
            # sum, unchanged until the inner loop ends): a repeat is a cycle torchgpipe
            # never leaves.
            state = (*splits, p)
            if state in seen or len(seen) > limit:
                how = "its moves cycle" if state in seen else f"over {limit} moves"
                raise PlanningError(
                    f"torchgpipe's blockpartition does not stop on these costs ({how}, "
                    f"splitting {n} layers into {k} stages); use fewer stages or another "
                    "strategy"
                )
            seen.add(state)
            if p < q:
                h = q - 1  # the last element of block q - 1 moves into q
                splits[h] -= 1
            else:
                h = q + 1  # the first element of block q + 1 moves into q
                splits[q] += 1
            sums[q] = _block_sum(normal, splits, q)
            sums[h] = _block_sum(normal, splits, h)
            if p == h:
                break


def _block_sum(normal: list[float], splits: list[int], j: int) -> float:
    """Block ``j``'s normalized sum, summed as torchgpipe sums it (``sum`` of the slice)."""
    start = splits[j - 1] if j > 0 else 0
    return sum(normal[start : splits[j]])


def _counts(splits: list[int], values: list[float]) -> list[int]:
    """The block lengths torchgpipe returns, refused unless every stage is a real one."""
    lengths = [len(values[a:b]) for a, b in zip([0, *splits[:-1]], splits, strict=True)]
    if sum(lengths) != len(values) or min(lengths) < 1:
        empty = next((j for j, c in enumerate(lengths) if c < 1), None)
        what = f"stage {empty} empty" if empty is not None else "layers out of every stage"
        raise PlanningError(
            f"torchgpipe's blockpartition leaves {what} on these costs (it returns "
            f"{lengths}, which its GPipe refuses); use fewer stages or another strategy"
        )
    return lengths


def _check(values: list[float], stages: int) -> None:
    """Raises ``ValueError`` unless ``values`` can be split into ``stages`` blocks."""
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ValueError(f"stages must be an integer, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > len(values):
        raise ValueError(
            f"cannot split {len(values)} layers into {stages} non-empty stages "
            "(stages must not exceed the number of layers)"
        )
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"costs must be non-negative and finite, got {v!r} at index {i}")
