"""Byte-size parsing and formatting."""

from __future__ import annotations

import pytest

from autopipe.planning.model.quantities import format_bytes, format_time, parse_bytes, parse_rate


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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e999", "memory '1e999' is not a finite size; give e.g. 16GiB"),
        ("1e300TiB", "memory '1e300TiB' is not a finite size"),
        (float("inf"), "memory inf is not a finite size"),
        (float("nan"), "memory nan is not a finite size"),
        (-5, "memory size -5 is negative"),
        ("-1GB", "memory size '-1GB' is negative"),
    ],
)
def test_parse_rejects_sizes_no_device_has(text, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(text)


@pytest.mark.parametrize("value", [None, True, [1], {"a": 1}])
def test_parse_rejects_other_types(value):
    with pytest.raises(TypeError, match="memory must be a number or a string such as 16GiB"):
        parse_bytes(value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10GB", 1e10), ("10GB/s", 1e10), (" 1.5 GiB/s ", 1.5 * 2**30), ("1e10", 1e10), (5, 5.0)],
)
def test_parse_rate(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e999", "bandwidth '1e999' is not a finite rate; give e.g. 10GB/s"),
        ("1e999GB/s", "bandwidth '1e999GB/s' is not a finite rate"),
        (float("inf"), "bandwidth inf is not a finite rate"),
        (float("nan"), "bandwidth nan is not a finite rate"),
        ("0", "bandwidth must be positive, got '0'"),
        (-1.0, "bandwidth must be positive, got -1.0"),
        ("fast", "cannot parse bandwidth 'fast'"),
    ],
)
def test_parse_rate_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rate(text)


def test_parse_names_what_it_parses():
    with pytest.raises(ValueError, match="allreduce_bandwidth '1e999'"):
        parse_rate("1e999", "allreduce_bandwidth")
    with pytest.raises(TypeError, match="allreduce_bandwidth must be a number"):
        parse_rate(None, "allreduce_bandwidth")  # type: ignore[arg-type]


def test_format():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_time(0.0123) == "12.3 ms"
    assert format_time(2.5e-6) == "2.5 µs"
