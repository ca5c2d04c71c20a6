"""The distributed training example, run with torchrun on CPU ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import ROOT

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


def test_torchrun_trains_the_gpt2_example_with_its_tied_head(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    example = ROOT / "examples" / "gpt2.py"
    saved = tmp_path / "state.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(example), "--steps", "2", "--layers", "2"]
    # Float64 and SGD: the pipeline and the plain model differ only in the order of a few
    # sums, far below any tolerance a real difference would pass (Adam in float32 would
    # turn that rounding noise into whole steps of lr).
    command += ["--save", str(saved), "--dtype", "float64", "--optimizer", "sgd", "--lr", "0.1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # The split puts the embedding and the head on different ranks: each holds a copy.
    assert "tied: transformer.wte.weight = lm_head.weight on stages [0, 1]" in run.stdout
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", run.stdout)]
    sys.path.insert(0, str(example.parent))
    try:
        import gpt2
    finally:
        sys.path.remove(str(example.parent))
    plain = gpt2.model(2).to(torch.float64)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    expected = []
    for tokens in gpt2.batches(2):
        optimizer.zero_grad()
        loss = torch.stack(
            [gpt2.next_token_loss(plain(part), part) for part in tokens.tensor_split(4)]
        ).mean()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert len(losses) == 2
    assert losses == pytest.approx(expected, rel=1e-6)  # printed with 6 decimals
    state = torch.load(saved)
    assert list(state) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=key)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "balance": "x"}'])
def test_a_bad_plan_file_stops_every_rank_with_one_line(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "BAD.json"
    bad.write_text(content)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE), "--steps", "1", "--plan", str(bad)]
    command += ["--timeout", "60"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode != 0
    # No rank's traceback (torchrun's own report of the failed ranks follows theirs).
    assert 'train_distributed.py", line' not in run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if str(bad) in line]
    assert sorted(line.split(":")[0] for line in lines) == ["rank 0", "rank 1"], run.stderr
