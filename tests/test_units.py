"""Byte-size parsing and formatting."""

from __future__ import annotations

import pytest

from autopipe.units import format_bytes, format_time, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("16GiB", 16 * 2**30), ("512 MB", 512 * 10**6), ("1e9", 10**9), ("1.5k", 1500), (7, 7)],
)
def test_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "16 GiBs", "-1GB", "1..2"])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


def test_format():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_time(0.0123) == "12.3 ms"
    assert format_time(2.5e-6) == "2.5 µs"
