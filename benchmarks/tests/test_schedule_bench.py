"""The schedule benchmark's rows and table, from made-up ``autopipe bench`` records (the
runs themselves are ``autopipe bench --ranks``, tested in tests/cli)."""

from __future__ import annotations

from typing import Any

from benchmarks.distributed import schedule_bench


def _record(schedule: str, per_rank: int, optimal: float, in_place: str) -> dict[str, Any]:
    stages = 2 * per_rank

    def split(label: str, measured: float) -> dict[str, Any]:
        return {
            "label": label,
            "balance": [1] * stages,
            "measured": measured,
            "spread": 0.05,
            "predicted": measured / 1.1,
            "measured_over_predicted": 1.1,
            "times": [measured] * 3,
        }

    return {
        "settings": {
            "stages": stages,
            "stages_per_rank": per_rank,
            "chunks": 8,
            "schedule": schedule,
            "checkpoint": "never",
            "in_place": in_place,
            "calibrated": "calibrated: ...",
        },
        "splits": [split("optimal", optimal), split("uniform", 2 * optimal)],
    }


def test_rows_relative_to_1f1b_and_the_table() -> None:
    fitted = "predicted from in-place figures: each stage's forward and backward ..."
    rows = [
        {
            "model": "m",
            "schedule": "1f1b",
            **schedule_bench.row_of(_record("1f1b", 1, 0.2, fitted)),
        },
        {"model": "m", "schedule": "zbv", **schedule_bench.row_of(_record("zbv", 2, 0.1, ""))},
        {"model": "m", "schedule": "dualpipev", "error": "a rank failed"},
    ]
    schedule_bench.add_relative(rows)
    assert rows[0]["strategies"]["optimal"]["vs_1f1b"] == 1.0
    assert rows[1]["strategies"]["optimal"]["vs_1f1b"] == 0.5
    assert rows[1]["strategies"]["uniform"]["vs_1f1b"] == 0.5
    assert (rows[0]["source"], rows[1]["source"]) == ("in place", "profile")
    record = {
        "machine": {
            "processor": "x86_64",
            "cpus": 2,
            "platform": "Linux",
            "load_average": [3.0, 3.0, 3.0],
            "load_average_after": [4.0, 4.0, 4.0],
        },
        "settings": {"ranks": 2, "chunks": 8, "steps": 5, "warmup": 4},
        "seconds": 60.0,
        "rows": rows,
    }
    table = schedule_bench.render(record)
    assert "load average (1, 5, 15 min) 3.00, 3.00, 3.00 before" in table
    lines = [line for line in table.splitlines() if line.startswith("| m |")]
    assert len(lines) == 3
    assert (
        "| 4 (2/rank) | profile | [1, 1, 1, 1] | 100.0 ms ±5% | 90.9 ms | 1.10 | 0.50x |"
        in (lines[1])
    )
    assert "failed: a rank failed" in lines[2]
    # Every row has the header's cells.
    header = next(line for line in table.splitlines() if line.startswith("| model |"))
    assert all(line.count("|") == header.count("|") for line in lines)


def test_the_command_of_a_schedule() -> None:
    interleaved = schedule_bench.Schedule("1f1b", 2)
    assert interleaved.label == "interleaved 1f1b (v=2)"
    command = schedule_bench._command("m.py", interleaved, quick=True, out=schedule_bench.ROOT)
    assert command[command.index("--virtual-stages") + 1] == "2"
    assert command[command.index("--ranks") + 1] == "2" and "--recalibrate" in command
    assert "--virtual-stages" not in schedule_bench._command(
        "m.py", schedule_bench.Schedule("zbv"), quick=False, out=schedule_bench.ROOT
    )
