"""Sends what a user's model prints to stderr, so the command's stdout holds only its output.

A model file may print while it is imported, traced, profiled or trained (a banner, a
shape, a debug line). ``autopipe plan --export torch`` writes an export to stdout to be
redirected into a file; a print in between would corrupt it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__: list[str] = []  # internal to the command line


def _redirect_descriptor() -> int | None:
    """Points file descriptor 1 at stderr's; returns a copy of the old one, if it could."""
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (a closed stdout): nothing to protect
        return None
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        return None
    return saved


@contextlib.contextmanager
def model_output_to_stderr() -> Iterator[None]:
    """While the model's code runs, its prints go to stderr.

    Python's ``sys.stdout`` is redirected, and so is file descriptor 1, which
    subprocesses, spawned ranks and C extensions write to.
    """
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()  # what the command printed before stays before
    saved = _redirect_descriptor()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
