"""Cuts a split may not make: the users of a tensor written in place stay on one stage.

A tensor several layers use is copied to each stage holding a user when the stages do not
share it (ranks, or devices of their own). A parameter's copies stay equal (their
gradients are summed), and so do a buffer's that is only read; a tensor written during
forward (a shared batch norm's running statistics, a counter) would have copies that drift
apart. The runner marks such a tensor :attr:`profiler.profile.TiedState.unsplit`, and every
split solver takes the positions between its first and its last user as cuts it may not
make (:attr:`autopipe.planning.model.cost_model.CostModel.forbidden`), so that the best split
found is the best of the allowed ones, and a request with none gets one clear refusal.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection, Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.spans import stage_bounds
from profiler import Profile, TiedState

__all__ = ["keep_together"]

Mask = NDArray[np.bool_]

# Tensors named in a refusal; the rest are counted.
_NAMED = 3


def forbidden_cuts(tied: Iterable[TiedState], n: int, extra: Iterable[int] = ()) -> Mask:
    """Per boundary position ``0..n`` (a stage may start at p), whether no cut may go there.

    Args:
        tied: the tensors several layers use; those marked ``unsplit`` forbid every cut
            after their first user and up to their last.
        n: the number of layers.
        extra: further positions ``1..n−1`` where no cut may go.

    Raises:
        ValueError: an extra position is not between two layers.
    """
    mask = np.zeros(n + 1, dtype=bool)
    for item in tied:
        if item.unsplit:
            mask[item.layers[0] + 1 : item.layers[-1] + 1] = True
    for position in extra:
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
            raise ValueError(f"a forbidden cut must be a layer position, got {position!r}")
        if not 0 < position < n:
            raise ValueError(
                f"a forbidden cut must lie between two of the {n} layers (1..{n - 1}), "
                f"got {position}"
            )
        mask[position] = True
    return mask


def cuts_allowed(balance: Sequence[int], mask: Mask) -> bool:
    """Whether ``balance`` cuts at no forbidden position."""
    return not bool(mask[stage_bounds(balance)[1:-1]].any())


def most_stages(mask: Mask) -> int:
    """The most stages an allowed split can have: one more than the allowed cuts."""
    n = len(mask) - 1
    return 1 + (n - 1) - int(mask[1:n].sum())


def refusal(tied: Sequence[TiedState], names: Sequence[str], stages: int, mask: Mask) -> str:
    """Why no split into ``stages`` stages is allowed, naming the tensors and their users."""
    kept = [item for item in tied if item.unsplit]
    parts = [
        f"{item.names[0]} (used by {', '.join(names[k] for k in item.layers)})"
        for item in kept[:_NAMED]
    ]
    if len(kept) > _NAMED:
        parts.append(f"{len(kept) - _NAMED} more")
    most = most_stages(mask)
    fewer = "use one stage" if most == 1 else f"use at most {most} stages"
    which = "it is" if len(kept) == 1 else "each is"
    return (
        f"no split into {stages} stages keeps on one stage the users of {'; '.join(parts)}: "
        f"{which} written in place during forward, so a copy on each stage would drift "
        f"apart; {fewer}, run the stages on one device, or do not share it"
    )


def crossing(balance: Sequence[int], tied: Sequence[TiedState]) -> TiedState | None:
    """The first ``unsplit`` tensor whose users ``balance`` puts on two stages, or ``None``."""
    bounds = stage_bounds(balance)
    for item in tied:
        if item.unsplit:
            stages = set(np.searchsorted(bounds, item.layers, side="right").tolist())
            if len(stages) > 1:
                return item
    return None


def keep_together(profile: Profile, names: Collection[str]) -> Profile:
    """The profile with the tied tensors known by any of ``names`` marked ``unsplit``.

    The caller's profile is left as it is; without such a tensor it is returned itself.

    Args:
        profile: the profile to plan from.
        names: names (in the profile's naming: the model's) of tensors whose users the
            runner cannot give copies of their own.
    """
    wanted = set(names)
    marks = [not t.unsplit and bool(wanted.intersection(t.names)) for t in profile.tied]
    if not any(marks):
        return profile
    marked = copy.copy(profile)
    marked.tied = [
        dataclasses.replace(t, unsplit=True) if mark else t
        for t, mark in zip(profile.tied, marks, strict=True)
    ]
    return marked
