"""Whether the running forward is checkpointed, or a re-computation; set by both runners.

A checkpointed micro-batch runs its partition forward twice: once keeping no activations
(:func:`is_checkpointing` is true), and again in backward to rebuild them
(:func:`is_recomputing` is true). torchgpipe's functions of these names mean the same.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["checkpointing", "is_checkpointing", "is_recomputing", "recomputing"]

_state = threading.local()


def is_checkpointing() -> bool:
    """Whether the calling thread runs the first forward of a checkpointed micro-batch.

    That forward keeps no activations; its micro-batch runs again in backward.
    """
    return getattr(_state, "checkpointing", False)


def is_recomputing() -> bool:
    """Whether the calling thread is re-running a checkpointed forward in backward.

    Layers with side effects (deferred batch norm counting its inputs) skip them then, so a
    re-computed micro-batch is counted once.
    """
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def _marked(flag: str) -> Iterator[None]:
    previous = getattr(_state, flag, False)
    setattr(_state, flag, True)
    try:
        yield
    finally:
        setattr(_state, flag, previous)


def checkpointing() -> contextlib.AbstractContextManager[None]:
    """Marks the calling thread as running a checkpointed forward until the block ends."""
    return _marked("checkpointing")


def recomputing() -> contextlib.AbstractContextManager[None]:
    """Marks the calling thread as re-computing until the block ends."""
    return _marked("recomputing")
