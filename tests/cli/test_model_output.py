"""What a model prints goes to stderr: stdout holds only the command's output
(autopipe.cli.model_output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.cli import main
from tests.support.cli_support import FAST

NOISY_MODEL = """
import os
import torch
from torch import nn

print("noisy: imported")
os.system("echo noisy: from a subprocess")


class Loud(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        print("noisy: forward")
        return self.b(torch.relu(self.a(x)))


def model():
    print("noisy: built")
    return Loud()


sample = torch.randn(8, 8)
"""


@pytest.fixture
def noisy(tmp_path: Path) -> Path:
    path = tmp_path / "noisy.py"
    path.write_text(NOISY_MODEL)
    return path


def test_export_on_stdout_holds_no_model_output(
    capfd: pytest.CaptureFixture[str], noisy: Path
) -> None:
    code = main(["plan", str(noisy), "--export", "torch", *FAST])
    out, err = capfd.readouterr()
    assert code == 0
    assert "noisy" not in out
    assert out.startswith("# autopipe plan")
    compile(out, "export.py", "exec")  # the export is Python, as written
    for line in ("imported", "from a subprocess", "built", "forward"):
        assert f"noisy: {line}" in err


def test_profile_report_holds_no_model_output(
    capfd: pytest.CaptureFixture[str], noisy: Path, tmp_path: Path
) -> None:
    code = main(["profile", str(noisy), "-o", str(tmp_path / "p.json"), *FAST])
    out, err = capfd.readouterr()
    assert code == 0
    assert out.startswith("profiled 2 layers") and "noisy" not in out
    assert "noisy: forward" in err
