"""The ``autopipe`` command line: parse, call the library, print; its public name is ``main``."""

# The modules are internal. entry runs a command and reports failures as one line; parser
# builds the argument tree (with arguments, the option types and groups) and picks the
# command; options and inputs are what the commands share (defaults, option values and
# output checks; the profile, loaded or measured); model_file loads a model file, and checks
# refuses an unusable device or a profile of other layers early; plan, search, profile and
# calibrate are one command each.

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``autopipe``; returns the exit status (2 for bad input, 130 when interrupted)."""
    # The commands load torch and numpy; an interrupt while they load is still one line.
    try:
        from autopipe.cli.entry import main as run
    except KeyboardInterrupt:
        print("autopipe: interrupted", file=sys.stderr)
        return 130
    return run(argv)


__all__ = ["main"]
