"""Parsing and formatting of byte sizes and durations."""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "format_time", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parses a byte size such as ``16GiB``, ``512 MB`` or ``1e9``.

    Raises:
        ValueError: the text is not a non-negative size with a known unit.
    """
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"memory size must be a non-negative number of bytes, got {text!r}")
        return int(text)
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot parse memory size {text!r}: use a number with an optional unit "
            "such as 16GiB, 512MB or 1e9"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """Formats a byte count with a binary unit, e.g. ``1.50 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_time(seconds: float) -> str:
    """Formats a duration with a unit that keeps three significant digits."""
    # Thresholds once rounded, so that 999.6 µs is 1 ms, never 1e+03 µs.
    if seconds >= 0.9995:
        value, unit = seconds, "s"
    elif seconds >= 0.9995e-3:
        value, unit = seconds * 1e3, "ms"
    else:
        value, unit = seconds * 1e6, "µs"
    text = f"{value:.0f}" if value >= 999.5 else f"{value:.3g}"  # long runs: no exponent
    return f"{text} {unit}"
