"""The catalog-fit benchmark runs on the CPU and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fit_device_on_the_cpu(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.planning.fit_device", "--device", "cpu"]
    command += ["--models", "mlp", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "fit_cpu.json").read_text())
    mlp = record["models"]["mlp"]
    assert record["entry"] == "host" and mlp["units"] == 16
    assert mlp["byte_differences"] == []  # on the CPU the counted bytes are the measured ones
    assert 0 < mlp["median_error"] <= mlp["max_error"]
    assert set(mlp["efficiency"]) == {"compute", "memory", "overhead"}
    assert "| mlp | 16 |" in (tmp_path / "fit_cpu.md").read_text()
