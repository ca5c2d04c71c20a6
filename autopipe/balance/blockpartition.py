"""torchgpipe's ``blockpartition.solve``: the sequence cut into blocks, by its heuristic."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TypeVar

from autopipe.planning import partition

__all__: list[str] = []

Number = TypeVar("Number", int, float)


def solve(sequence: Sequence[Number], partitions: int = 1) -> list[list[Number]]:
    """Splits ``sequence`` into ``partitions`` contiguous blocks of even sums.

    This is the Bárány–Grinberg heuristic torchgpipe balances with (autopipe's
    ``strategy="blockpartition"``); it evens out the block sums but does not minimize the
    largest one: :func:`autopipe.partition` does.

    Args:
        sequence: non-negative, finite costs.
        partitions: number of blocks, ``1 <= partitions <= len(sequence)``.

    Returns:
        The blocks, each a non-empty run of ``sequence``.

    Raises:
        ValueError: ``partitions`` is below 1 or above ``len(sequence)``, or a cost is
            negative or not finite.
    """
    values = list(sequence)
    counts: list[int] = partition(values, partitions, strategy="blockpartition")
    bounds = [0, *itertools.accumulate(counts)]
    return [values[start:stop] for start, stop in itertools.pairwise(bounds)]
