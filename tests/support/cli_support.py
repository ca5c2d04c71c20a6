"""Helpers shared by the command-line tests: running ``main``, checking errors, model files."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from autopipe.cli import main
from profiler import Profile
from tests.support.paths import ROOT

MLP = str(ROOT / "examples" / "mlp.py")
FAST = ["--repeats", "1", "--warmup", "0"]

# A model file small enough to profile in a moment.
SMALL_MODEL = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
sample = torch.randn(8, 4)
"""

# A tiny Hugging Face Llama built on the meta device, as a model file (the sizes for hand
# counts); tests using it skip without transformers.
LLAMA_HIDDEN, LLAMA_FFN, LLAMA_HEADS, LLAMA_KV_HEADS = 32, 64, 4, 2
LLAMA_MODEL = f"""
import torch
import transformers

config = transformers.LlamaConfig(
    hidden_size={LLAMA_HIDDEN}, intermediate_size={LLAMA_FFN}, num_hidden_layers=2,
    num_attention_heads={LLAMA_HEADS}, num_key_value_heads={LLAMA_KV_HEADS}, vocab_size=50,
    max_position_embeddings=32,
)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
sample = torch.randint(0, 50, (4, 8))
"""
# Plans the model file for a catalog device, counting its layers afresh.
ON_TARGET = ["--target", "h100", "--stages", "2", "--no-cache"]


def llama_file(folder: Path) -> Path:
    """``folder/llama.py`` of :data:`LLAMA_MODEL`."""
    path = folder / "llama.py"
    path.write_text(LLAMA_MODEL)
    return path


def counted_profiles(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    path: Path,
    *options: str,
) -> list[Profile]:
    """The profiles ``autopipe plan PATH`` with :data:`ON_TARGET` and ``options`` counts
    (the run must succeed)."""
    import profiler

    made: list[Profile] = []
    profile_model = profiler.profile_model

    def recorded(*args: Any, **kwargs: Any) -> Profile:
        made.append(profile_model(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(profiler, "profile_model", recorded)
    code, _, err = run(capsys, "plan", str(path), *ON_TARGET, *options)
    assert code == 0, err
    return made


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plan_two_stages(
    capsys: pytest.CaptureFixture[str], path: Path, *options: str
) -> tuple[str, str]:
    """``autopipe plan PATH --stages 2``, quickly; it must succeed: its output and errors.

    Each command is a process of its own: the model file imports its ``helper`` anew.
    """
    sys.modules.pop("helper", None)
    code, out, err = run(capsys, "plan", str(path), "--stages", "2", *FAST, *options)
    assert code == 0, err
    return out, err


def plan_twice(
    capsys: pytest.CaptureFixture[str], path: Path, *options: str
) -> tuple[tuple[str, str], tuple[str, str]]:
    """:func:`plan_two_stages` twice, as a user plans again: each run's output and errors."""
    return plan_two_stages(capsys, path, *options), plan_two_stages(capsys, path, *options)


def plan_after_change(
    capsys: pytest.CaptureFixture[str],
    path: Path,
    change: Callable[[], object] | None,
    *options: str,
) -> tuple[str, str]:
    """Plans ``path``, makes the ``change`` (none: only the ``options`` differ) and plans
    twice with the ``options``: the errors of the run after the change (which must find
    nothing cached) and of the next one (which finds what that run recorded)."""
    plan_two_stages(capsys, path)
    if change is not None:
        change()
    (_, changed), (_, again) = plan_twice(capsys, path, *options)
    return changed, again


def write_model_file(folder: Path, source: str, beside: Mapping[str, str]) -> Path:
    """``folder/model.py`` of ``source``, with the files it reads (``helper.py``, ...)
    written beside it."""
    for name, text in beside.items():
        (folder / name).write_text(text)
    path = folder / "model.py"
    path.write_text(source)
    return path


def assert_error(code: int, out: str, err: str, expected: str = "") -> None:
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autopipe: error: ")
    assert expected in lines[0]


def make_profile_file(factory: pytest.TempPathFactory) -> Path:
    """Profiles examples/mlp.py once, quickly, for tests that plan from a saved profile."""
    path = factory.mktemp("profile") / "mlp.json"
    assert main(["profile", MLP, "-o", str(path), *FAST]) == 0
    return path


# A model that is not an nn.Sequential: residual blocks in a ModuleList.
RESIDUAL_MODEL = """import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)


model = Residual()
sample = torch.randn(8, 8)
"""
