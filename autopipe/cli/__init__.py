"""The command line: parse, call the library, print."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``autopipe``; returns the exit status (2 for bad input, 130 when interrupted)."""
    # The commands load torch and numpy; an interrupt while they load is still one line.
    try:
        from autopipe.cli.app import main as run
    except KeyboardInterrupt:
        print("autopipe: interrupted", file=sys.stderr)
        return 130
    return run(argv)


__all__ = ["main"]
