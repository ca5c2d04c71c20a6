"""A progress line for terminals, to pass as ``profile_layers(progress=...)``."""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["TerminalProgress"]


class TerminalProgress:
    """Writes ``profiling layer 3/24 (2)`` to stderr, rewriting one line in place.

    Prints nothing when the stream is not a terminal, so logs and pipes stay clean.

    Args:
        stream: where to write; default: ``sys.stderr`` at the time of each call.
        kinds: optional layer name to class name map, shown as ``(2: Linear)``.
    """

    def __init__(self, stream: TextIO | None = None, kinds: dict[str, str] | None = None):
        self._stream = stream
        self._kinds = dict(kinds or {})
        self._width = 0

    @property
    def stream(self) -> TextIO:
        return sys.stderr if self._stream is None else self._stream

    def enabled(self) -> bool:
        """Whether the stream is a terminal."""
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):  # closed or file-like without isatty
            return False

    def __call__(self, done: int, total: int, name: str) -> None:
        """Shows that ``done`` of ``total`` layers are profiled, the last one ``name``."""
        if not self.enabled():
            return
        label = f"{name}: {self._kinds[name]}" if name in self._kinds else name
        line = f"profiling layer {done}/{total} ({label})"
        # Pad with spaces to wipe the rest of a longer previous line.
        self.stream.write("\r" + line.ljust(self._width))
        self._width = len(line)
        if done >= total:
            self.stream.write("\n")
            self._width = 0
        self.stream.flush()
