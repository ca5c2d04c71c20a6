"""The ``autopipe`` command line: parse, call the library, print.

Its one public name is :func:`main`. The modules are internal: :mod:`~autopipe.cli.entry`
runs a command, :mod:`~autopipe.cli.parser` builds the argument parser and picks the
command, :mod:`~autopipe.cli.options` and :mod:`~autopipe.cli.inputs` hold what the commands share
(defaults, option values and output checks; the profile, loaded or measured),
:mod:`~autopipe.cli.model_file` loads a model file and :mod:`~autopipe.cli.checks` checks
inputs early; each command has its module
(:mod:`~autopipe.cli.plan`, :mod:`~autopipe.cli.search`, :mod:`~autopipe.cli.profile`,
:mod:`~autopipe.cli.calibrate`).
"""

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
