"""Whether the running forward is a re-computation, set by both runners when they replay one."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["is_recomputing", "recomputing"]

_state = threading.local()


def is_recomputing() -> bool:
    """Whether the calling thread is re-running a checkpointed forward in backward.

    Layers with side effects (deferred batch norm counting its inputs) skip them then, so a
    re-computed micro-batch is counted once.
    """
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Marks the calling thread as re-computing until the block ends."""
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous
