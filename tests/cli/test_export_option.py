"""``autopipe plan --export FORMAT[=FILE]``: the split for other runtimes, to files or stdout."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from autopipe.planning.model.plans import Plan
from tests.support.cli_support import FAST, MLP, assert_error, run
from tests.support.tomlfile import read_toml

# torchtitan's names: tok_embeddings, layers.N (a ModuleDict), norm, output.
LLAMA_LIKE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        # The blocks outweigh the head, so that every split keeps norm and output together.
        self.tok_embeddings = nn.Embedding(32, 32)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(6)})
        self.norm = nn.LayerNorm(32)
        self.output = nn.Linear(32, 32)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


torch.manual_seed(0)
model = Model()
sample = torch.randint(0, 32, (8, 5))
"""


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "llama.py"
    path.write_text(LLAMA_LIKE)
    return path


def test_exports_to_stdout_and_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_file: Path
) -> None:
    files = {fmt: tmp_path / f"split.{fmt}" for fmt in ("torchtitan", "megatron", "deepspeed")}
    # Times estimated from the counts: the split does not depend on this host's timings
    # (one ending at the final norm is no split Megatron-LM takes).
    argv = ["plan", str(model_file), "--stages", "2", "--target", "h100"]
    argv += ["--json", str(tmp_path / "p.json"), "--export", "torch"]
    argv += [f"--export={fmt}={path}" for fmt, path in files.items()]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    plan = Plan.load(tmp_path / "p.json")
    names = [name for stage in plan.stages for name in stage.layers]
    assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm", "output"]
    # stdout holds the snippet alone, runnable as it is; the report went to stderr.
    code_ns: dict[str, Any] = {}
    exec(out, code_ns)
    assert list(code_ns["split_spec"]) == [plan.stages[1].layers[0]]
    assert "9 layers on 2 stages" in err and "torchtitan export written to" in err
    parts = read_toml(files["torchtitan"].read_text())["parallelism"]
    assert parts["module_fqns_per_model_part"] == [stage.layers for stage in plan.stages]
    counts = [sum(name.startswith("layers.") for name in stage.layers) for stage in plan.stages]
    layout = re.search(r'layout "([^"]+)"', files["megatron"].read_text())
    assert layout is not None
    stages = re.sub(r"t\*(\d+)", lambda m: "t" * int(m.group(1)), layout.group(1)).split("|")
    assert [stage.count("t") for stage in stages] == counts
    assert json.loads(files["deepspeed"].read_text())["parts"] == [0, plan.balance[0], 9]


def test_the_report_stays_on_stdout_when_every_export_has_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_file: Path
) -> None:
    target = tmp_path / "split.json"
    argv = ["plan", str(model_file), "--stages", "3", *FAST, "--export", f"torch-json={target}"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "9 layers on 3 stages" in out
    assert len(json.loads(target.read_text())["split_spec"]) == 2


def test_an_unknown_format_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing.py")  # not even read: the format is checked first
    expected = "--export onnx: unknown export format 'onnx'; choose torch, torch-json"
    assert_error(*run(capsys, "plan", missing, "--export", "onnx"), expected)
    assert_error(*run(capsys, "plan", missing, "--export", "torch="), "no file after '='")
    nowhere = str(tmp_path / "no" / "dir.py")
    assert_error(*run(capsys, "plan", missing, "--export", f"torch={nowhere}"), "does not exist")
    argv = ["plan", MLP, "--search", "--export", "torch"]
    assert_error(*run(capsys, *argv), "--export goes with a plan of --stages")


def test_a_split_the_format_cannot_hold_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan_file = tmp_path / "plan.json"
    argv = ["plan", MLP, "--stages", "2", *FAST, "--json", str(plan_file), "--export", "megatron"]
    code, out, err = run(capsys, *argv)
    assert_error(code, out, err, "cannot export the plan as megatron: no stack of decoder layers")
    assert not plan_file.exists()


def test_a_profile_with_slash_names_still_matches(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_file: Path
) -> None:
    profile = tmp_path / "profile.json"
    assert run(capsys, "profile", str(model_file), "-o", str(profile), *FAST)[0] == 0
    data = json.loads(profile.read_text())
    assert data["layers"][1]["name"] == "layers.0"  # the dotted name named_modules() gives
    for layer in data["layers"]:  # as profiles were written before
        layer["name"] = layer["name"].replace(".", "/")
    profile.write_text(json.dumps(data))
    plan_file = tmp_path / "plan.json"
    argv = ["plan", str(model_file), "--profile", str(profile), "--json", str(plan_file)]
    code, out, err = run(capsys, *argv, "--stages", "2")
    assert code == 0, err
    plan = Plan.load(plan_file)
    names = [name for stage in plan.stages for name in stage.layers]
    assert names[:2] == ["tok_embeddings", "layers.0"] and len(plan.stages) == 2
    assert "layers/" not in out
