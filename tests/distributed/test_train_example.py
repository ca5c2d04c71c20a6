"""The distributed training example, run with torchrun on CPU ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_torchrun_trains_the_gpt2_example_with_its_tied_head(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    example = ROOT / "examples" / "gpt2.py"
    saved = tmp_path / "state.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(example), "--steps", "2", "--layers", "2"]
    command += ["--save", str(saved)]
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
    # The plain model trained alike (one thread, as each rank): same losses and weights.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = gpt2.model(2)
        optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
        expected = []
        for tokens in gpt2.batches(2):
            optimizer.zero_grad()
            loss = torch.stack(
                [gpt2.next_token_loss(plain(part), part) for part in tokens.tensor_split(4)]
            ).mean()
            loss.backward()
            optimizer.step()
            expected.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses == pytest.approx(expected, rel=1e-5)
    state = torch.load(saved)
    assert list(state) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        got = state[key]
        if key.endswith("attn.c_attn.bias"):
            # The key projection's bias cannot change attention (softmax ignores a shift
            # along the keys): its exact gradient is zero, so it gets rounding noise, which
            # Adam scales up to steps of up to lr either way. Compare it by that bound.
            width = value.numel() // 3
            keys = slice(width, 2 * width)
            torch.testing.assert_close(got[keys], value[keys], rtol=0.0, atol=2 * 1e-3)
            got, value = got.clone(), value.clone()
            got[keys] = value[keys] = 0.0
        torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-6, msg=key)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
