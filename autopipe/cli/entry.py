"""The ``autopipe`` command: parse the arguments, run the command, report failures as one line."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from autopipe.cli.parser import PROG, build_parser, selected_command

__all__: list[str] = []  # autopipe.cli.main is the public entry point


def _fail(message: str) -> int:
    line = " ".join(message.split()) or "failed"
    print(f"{PROG}: error: {line}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``autopipe`` command.

    Args:
        argv: the arguments after the program name; default: ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for bad input (usage errors included), with a
        one-line ``autopipe: error:`` message on stderr; 130 when interrupted.
    """
    # Everything runs inside the handlers, the parser and the lazy imports of torch and
    # scipy included: a Ctrl-C at any point is one line, and files are written atomically.
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, or a usage error argparse has reported
            return exc.code if isinstance(exc.code, int) else 2
        status: int = selected_command(args)(args)
    except KeyboardInterrupt:
        # A progress line may be open on a terminal: end it first.
        start = "\n" if sys.stderr.isatty() else ""
        print(f"{start}{PROG}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # ModelFileError and PlanningError included
        return _fail(str(exc))
    return status
