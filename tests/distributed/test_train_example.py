"""The distributed training example, run with torchrun on CPU ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_distributed.py"


def test_torchrun_trains_and_saves_the_original_state_dict(tmp_path: Path) -> None:
    saved = tmp_path / "state.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE), "--steps", "3", "--calibrate"]
    command += ["--bind-cpus"]  # under torchrun: LOCAL_RANK of LOCAL_WORLD_SIZE
    command += ["--save", str(saved), "--timeout", "60"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "calibrated: message latency" in run.stdout
    assert re.search(r"plan: balance \[\d+, \d+\].*predicted step", run.stdout)
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 3
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from train_distributed import build_model
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    model = build_model()
    state = torch.load(saved)
    assert sorted(state) == sorted(model.state_dict())
    model.load_state_dict(state)  # the gathered stages load into the plain model
