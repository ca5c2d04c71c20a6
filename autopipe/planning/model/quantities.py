"""Parsing and formatting of byte sizes and durations."""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["format_bytes", "format_time", "parse_bytes", "parse_rate"]

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

_SIZE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _amount(text: object, what: str, kind: str, example: str, per: str = "") -> float | None:
    """The float ``text`` stands for (number, or number and unit, optionally followed by
    ``per``, e.g. ``/s``), ``None`` if unparseable.

    Raises:
        TypeError: ``text`` is neither a string nor a number.
        ValueError: the amount is not finite (e.g. ``1e999``, which ``int()`` cannot hold).
    """
    if isinstance(text, bool) or not isinstance(text, (str, numbers.Real)):
        raise TypeError(f"{what} must be a number or a string such as {example}, got {text!r}")
    if isinstance(text, str):
        stripped = text.strip()
        if per and stripped.lower().endswith(per):
            stripped = stripped[: -len(per)]
        match = _SIZE.match(stripped)
        if match is None or match.group(2).lower() not in _UNITS:
            return None
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is not a finite {kind}; give e.g. {example}")
    return value


def parse_bytes(text: str | float, what: str = "memory") -> int:
    """Parses a byte size such as ``16GiB``, ``512 MB`` or ``1e9``.

    Args:
        text: the size, a number of bytes or a number with a unit.
        what: what the size is, for the error message.

    Raises:
        ValueError: the text is not a finite, non-negative size with a known unit.
        TypeError: ``text`` is neither a string nor a number.
    """
    value = _amount(text, what, "size", "16GiB")
    if value is None:
        raise ValueError(
            f"cannot parse {what} size {text!r}: use a number with an optional unit "
            "such as 16GiB, 512MB or 1e9"
        )
    if value < 0:
        raise ValueError(f"{what} size {text!r} is negative; give e.g. 16GiB")
    return int(value)


def parse_rate(text: str | float, what: str = "bandwidth") -> float:
    """Parses a rate in bytes per second such as ``10GB``, ``10GB/s`` or ``1e10``.

    Args:
        text: the rate, a number of bytes per second or a number with a unit.
        what: what the rate is, for the error message.

    Raises:
        ValueError: the text is not a finite, positive rate with a known unit.
        TypeError: ``text`` is neither a string nor a number.
    """
    rate = _amount(text, what, "rate", "10GB/s", per="/s")
    if rate is None:
        raise ValueError(
            f"cannot parse {what} {text!r}: use bytes per second such as 10GB, 10GB/s or 1e10"
        )
    if not rate > 0:
        raise ValueError(f"{what} must be positive, got {text!r}; give e.g. 10GB/s")
    return rate


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
