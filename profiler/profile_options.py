"""``ProfileOptions``: how :func:`profiler.profile_layers` measures, as one frozen value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__: list[str] = []


@dataclass(frozen=True)
class ProfileOptions:
    """The options of :func:`profiler.profile_layers`; see there for each field."""

    device: str | torch.device = "cpu"
    chunks: int = 1
    batch_sizes: Sequence[int] | None = None
    names: Sequence[str] | None = None
    warmup: int = 2
    repeats: int = 5
    progress: Callable[[int, int, str], None] | None = None
    pool: bool = True
    cold_cache: bool | None = None
    autocast: str | None = None
    owner: nn.Module | None = None
    measure: bool = True
    count: bool = True
    shard_styles: Sequence[Mapping[str, str]] | None = None
    expert_skew: float = 1.0


_FIELDS = frozenset(f.name for f in dataclasses.fields(ProfileOptions))


def with_options(
    options: ProfileOptions | None, overrides: Mapping[str, Any], caller: str
) -> ProfileOptions:
    """``options`` (default: all defaults) with the keywords of ``caller()`` laid over it.

    Raises:
        TypeError: ``options`` is not a :class:`ProfileOptions`, or a keyword is not one of
            its fields (the message lists them, on one line).
    """
    if options is None:
        options = ProfileOptions()
    elif not isinstance(options, ProfileOptions):
        raise TypeError(
            f"{caller}() takes options=ProfileOptions(...), got {type(options).__name__}"
        )
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        word = "keyword arguments" if len(unknown) > 1 else "keyword argument"
        raise TypeError(
            f"{caller}() got an unexpected {word} {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(sorted(_FIELDS))}"
        )
    return dataclasses.replace(options, **overrides) if overrides else options
