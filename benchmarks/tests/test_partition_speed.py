"""The partition-speed benchmark's rows: both input kinds, each figure's spread in order."""

from __future__ import annotations

from benchmarks.planning.partition_speed import _markdown, measure


def test_rows_pair_partition_with_the_cumsum_of_the_same_costs():
    rows = measure(layers=2_000, stages=8, rounds=3)
    assert [r["input"] for r in rows] == ["array", "list"]
    for row in rows:
        assert (row["layers"], row["stages"]) == (2_000, 8)
        for figure in ("partition_seconds", "cumsum_seconds", "ratio"):
            spread = row[figure]
            assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    report = _markdown({"machine": "m", "load": "0.00", "rounds": 3, "rows": rows})
    assert report.count("| 2,000 | 8 |") == 2
