"""The bench suite: a quick run on a tiny model writes its table; the tie rule of a row."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.balance import bench_suite
from benchmarks.balance.bench_table import row_of, slower

TINY = """
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)], nn.Linear(16, 64))


def sample():
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
"""


def test_quick_run_writes_one_row_per_setting(tmp_path: Path) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(TINY)
    out = tmp_path / "results"
    record = bench_suite.main(["--quick", "--models", str(model), "--out", str(out)])
    saved = json.loads((out / "bench_suite.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(record["rows"]))
    assert [row["setting"] for row in saved["rows"]] == [s.label for s in bench_suite.SETTINGS]
    for row, setting in zip(saved["rows"], bench_suite.SETTINGS, strict=True):
        assert "error" not in row, row.get("error")
        assert row["model"] == "tiny" and row["stages"] == setting.stages
        assert row["runner"] == ("distributed" if setting.ranks else "gpipe")
        assert list(row["strategies"]) == list(bench_suite.STRATEGIES)
        assert row["strategies"]["optimal"]["relative"] == 1.0
        for entry in row["strategies"].values():
            assert sum(entry["balance"]) == 6 and len(entry["balance"]) == setting.stages
            assert entry["measured"] > 0 and entry["spread"] >= 0
        assert row["optimal_over_ideal"] > 0
        assert row["optimal_no_slower"] == (not row["optimal_slower_than"])
        assert row["above_ideal"] == (row["optimal_over_ideal"] > 1.1)
        assert row["over_predicted"][0] == row["optimal_over_predicted"] > 0
        if setting.ranks:  # calibrated on the ranks, profiled bound as a rank
            assert row["calibrated"].startswith("calibrated: the runner costs")
            assert "profiled on the 2 ranks at once" in row["profiled"] and not row["shared"]
        else:
            assert row["shared"] and row["calibrated"] == ""
    table = (out / "bench_suite.md").read_text()
    assert table.count("| tiny |") == len(bench_suite.SETTINGS)
    assert "load average" in table and "opt meas/pred" in table


def _split(label: str, measured: float, spread: float, over_ideal: float = 1.0) -> dict:
    return {
        "label": label,
        "balance": [1, 1],
        "measured": measured,
        "spread": spread,
        "predicted": measured,
        "ideal": measured / over_ideal,
        "measured_over_ideal": over_ideal,
        "measured_over_predicted": 1.0,
        "bound_unit": {"name": "head", "cost": 1.0},
    }


def test_a_gap_within_the_spread_is_a_tie() -> None:
    assert not slower(_split("a", 1.05, 0.10), _split("b", 1.0, 0.02))
    assert slower(_split("a", 1.2, 0.10), _split("b", 1.0, 0.02))
    record = {
        "settings": {"stages": 2, "chunks": 4, "runner": "gpipe"},
        "splits": [_split("optimal", 1.2, 0.05, over_ideal=1.5), _split("uniform", 1.0, 0.05)],
    }
    row = row_of(record, ("optimal", "uniform"))
    assert row["optimal_slower_than"] == ["uniform"] and not row["optimal_no_slower"]
    assert row["bound_unit"] == "head"
    assert row["strategies"]["uniform"]["relative"] == 1.0 / 1.2


def test_each_row_shows_measured_over_predicted() -> None:
    from benchmarks.balance.bench_table import render

    optimal, uniform = _split("optimal", 1.0, 0.05), _split("uniform", 1.2, 0.05)
    optimal["measured_over_predicted"], uniform["measured_over_predicted"] = 1.02, 0.97
    record = {
        "settings": {"stages": 2, "chunks": 4, "runner": "gpipe"},
        "splits": [optimal, uniform],
    }
    row = {**row_of(record, ("optimal", "uniform")), "model": "m", "setting": "K=2, GPipe"}
    assert row["over_predicted"] == [1.02, 0.97] and row["optimal_over_predicted"] == 1.02
    machine = {"processor": "x", "cpus": 2, "platform": "p", "load_average": [0.1]}
    table = render(
        {
            "machine": {**machine, "load_average_after": [0.2]},
            "settings": {"steps": 6, "warmup": 2},
            "seconds": 60.0,
            "rows": [row],
        },
        ("optimal", "uniform"),
    )
    assert "| 1.02 | 0.97–1.02 |" in table
