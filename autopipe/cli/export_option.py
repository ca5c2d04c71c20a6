"""``--export FORMAT[=FILE]``: the plan's split for other runtimes, checked before any work."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopipe.cli.options import check_writable
from autopipe.planning import check_export_format

if TYPE_CHECKING:
    from autopipe.planning import Plan

__all__: list[str] = []  # internal to the command line


@dataclass(frozen=True)
class Export:
    """One ``--export``: a format, and the file to write it to (``None``: stdout)."""

    fmt: str
    path: str | None


def parse_exports(values: Sequence[str] | None) -> list[Export]:
    """The ``--export`` values, each format known and each file writable.

    Raises:
        ValueError: an unknown format, an empty file name, or a file that cannot be written.
    """
    exports = []
    for value in values or ():
        fmt, eq, path = value.partition("=")
        try:
            check_export_format(fmt)
        except ValueError as exc:
            raise ValueError(f"--export {value}: {exc}") from None
        if eq and not path:
            raise ValueError(f"--export {value}: no file after '='; give {fmt}=FILE or {fmt}")
        if path:
            check_writable(path, f"{fmt} export")
        exports.append(Export(fmt, path or None))
    return exports


def render_exports(plan: Plan, exports: Sequence[Export]) -> list[str]:
    """Each export's text, all made before any is written.

    Raises:
        ValueError: a format cannot express the plan (the message names the cut).
    """
    return [plan.export(export.fmt) for export in exports]


def to_stdout(exports: Sequence[Export]) -> bool:
    """Whether an export goes to stdout (the report then goes to stderr)."""
    return any(export.path is None for export in exports)


def write_exports(exports: Sequence[Export], texts: Sequence[str]) -> None:
    """Writes each text to its file or to stdout, naming the files on stderr.

    Raises:
        ValueError: a file cannot be written.
    """
    printed = False
    for export, text in zip(exports, texts, strict=True):
        if export.path is None:
            sys.stdout.write(("\n" if printed else "") + text)  # a blank line between
            printed = True
            continue
        try:
            with open(export.path, "w", encoding="utf-8") as file:
                file.write(text)
        except OSError as exc:
            raise ValueError(
                f"cannot write the {export.fmt} export to {export.path}: {exc.strerror or exc}"
            ) from None
        print(f"{export.fmt} export written to {export.path}", file=sys.stderr)
