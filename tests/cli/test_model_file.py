"""Tests of loading a user's model file (autopipe.cli.model_file)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autopipe.cli.model_file import (
    ModelFileError,
    as_sequential,
    load_model_file,
    load_sequential,
)
from tests.support.cli_support import RESIDUAL_MODEL
from tests.support.paths import EXAMPLES

GOOD = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
sample = torch.randn(6, 4)
"""


def write(directory: Path, text: str, name: str = "model.py") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def error_of(path: Path, sequential: bool = False) -> str:
    with pytest.raises(ModelFileError) as info:
        if sequential:
            load_sequential(path)
        else:
            load_model_file(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_loads_values(tmp_path: Path) -> None:
    loaded = load_model_file(write(tmp_path, GOOD))
    assert isinstance(loaded.model, nn.Sequential)
    assert isinstance(loaded.sample, torch.Tensor)
    assert loaded.batch_size == 6
    assert loaded.path == (tmp_path / "model.py").resolve()
    assert issubclass(ModelFileError, ValueError)


def test_calls_zero_argument_functions(tmp_path: Path) -> None:
    text = """
import torch
from torch import nn

class Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(3, 3), nn.Tanh())

model = Net

def sample():
    return [torch.randn(5, 3)]
"""
    model, sample = load_sequential(write(tmp_path, text))
    assert type(model).__name__ == "Net"
    assert isinstance(sample, tuple) and sample[0].shape == (5, 3)


def test_tuple_sample(tmp_path: Path) -> None:
    text = GOOD + "\nsample = (torch.randn(6, 4), torch.zeros(6, dtype=torch.long))\n"
    loaded = load_model_file(write(tmp_path, text))
    assert isinstance(loaded.sample, tuple) and len(loaded.sample) == 2
    assert loaded.batch_size == 6


def test_sibling_import_and_sys_path_restored(tmp_path: Path) -> None:
    write(
        tmp_path,
        "from torch import nn\n\ndef layers():\n    return [nn.Linear(2, 2)]\n",
        "blocks.py",
    )
    text = "import torch\nfrom torch import nn\nfrom blocks import layers\n"
    text += "model = nn.Sequential(*layers())\nsample = torch.randn(3, 2)\n"
    before = list(sys.path)
    model, _ = load_sequential(write(tmp_path, text))
    assert len(model) == 1
    assert sys.path == before
    sys.modules.pop("blocks", None)


def test_same_file_name_in_two_directories(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    first = load_model_file(write(one, GOOD))
    second = load_model_file(write(two, GOOD.replace("nn.Linear(8, 2)", "nn.Linear(8, 5)")))
    assert first.module.__name__ != second.module.__name__
    assert as_sequential(first.model, first.sample)[0][2].out_features == 2
    assert as_sequential(second.model, second.sample)[0][2].out_features == 5


def test_examples_load() -> None:
    for name, layers in (("mlp.py", 16), ("convnet.py", 16)):
        model, sample = load_sequential(EXAMPLES / name)
        assert len(model) == layers
        assert isinstance(sample, torch.Tensor) and sample.shape[0] == 32


def test_missing_file(tmp_path: Path) -> None:
    assert "not found" in error_of(tmp_path / "nope.py")


def test_directory(tmp_path: Path) -> None:
    assert "is a directory" in error_of(tmp_path)


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "import torch\n\nmodel = (\n"))
    assert message.startswith("syntax error in ")
    assert "line 3" in message


def test_exception_while_importing(tmp_path: Path) -> None:
    before = {name for name in sys.modules if name.startswith("_autopipe_model_")}
    message = error_of(write(tmp_path, "import torch\nraise RuntimeError('no\\nGPU here')\n"))
    assert "line 2" in message
    assert "RuntimeError: no GPU here" in message
    after = {name for name in sys.modules if name.startswith("_autopipe_model_")}
    assert after == before  # a failed import leaves no module behind


def test_missing_sibling_module(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "import not_a_module_anywhere_xyz\n"))
    assert "ModuleNotFoundError" in message


def test_missing_model_and_sample(tmp_path: Path) -> None:
    no_model = error_of(write(tmp_path, "import torch\nsample = torch.randn(2, 2)\n"))
    assert "defines no `model`" in no_model and "nn.Sequential" in no_model
    no_sample = error_of(write(tmp_path, "from torch import nn\nmodel = nn.Linear(2, 2)\n"))
    assert "defines no `sample`" in no_sample


@pytest.mark.parametrize(
    ("model", "sample", "expected"),
    [
        ("3", "torch.randn(2, 2)", "must be an nn.Module"),
        ("nn.Linear(2, 2)", "[1, 2]", "got a list of int, int"),
        ("nn.Linear(2, 2)", "'text'", "got str"),
        ("nn.Linear(2, 2)", "()", "got an empty tuple"),
        ("nn.Linear(2, 2)", "torch.tensor(1.0)", "0-d tensor"),
        ("nn.Linear(2, 2)", "(torch.randn(2, 2), torch.randn(3, 2))", "disagree"),
        ("nn.Linear(2, 2)", "torch.randn(0, 2)", "empty batch"),
    ],
)
def test_wrong_types(tmp_path: Path, model: str, sample: str, expected: str) -> None:
    text = f"import torch\nfrom torch import nn\nmodel = {model}\nsample = {sample}\n"
    assert expected in error_of(write(tmp_path, text))


def test_failing_or_non_zero_argument_function(tmp_path: Path) -> None:
    text = "import torch\nfrom torch import nn\ndef model():\n    raise KeyError('x')\n"
    text += "sample = torch.randn(2, 2)\n"
    message = error_of(write(tmp_path, text))
    assert "calling `model()`" in message and "KeyError" in message and "line 4" in message
    text = "import torch\nfrom torch import nn\ndef model(width):\n    return nn.Linear(2, width)\n"
    text += "sample = torch.randn(2, 2)\n"
    message = error_of(write(tmp_path, text))
    assert "TypeError" in message and "taking no arguments" in message


UNTRACEABLE = """import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow
            return self.a(x)
        return self.b(x)


model = Branchy()
sample = torch.randn(2, 2)
"""


def test_non_sequential_model_is_split_into_units(tmp_path: Path) -> None:
    loaded = load_model_file(write(tmp_path, RESIDUAL_MODEL))
    layers, sample = as_sequential(loaded.model, loaded.sample)
    assert isinstance(layers, nn.Sequential) and len(layers) == 6
    assert isinstance(sample, tuple)
    out = layers(*sample)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, loaded.model(loaded.sample))


def test_untraceable_model_is_a_one_line_error(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, UNTRACEABLE), sequential=True)
    assert "cannot split `model`" in message and "Branchy" in message


def test_as_sequential() -> None:
    model = nn.Sequential(nn.ReLU())
    sample = torch.randn(2, 2)
    assert as_sequential(model, sample) == (model, sample)
    with pytest.raises(ModelFileError, match="empty nn.Sequential"):
        as_sequential(nn.Sequential(), sample)


TWO_INPUTS = """
import torch
from torch import nn

class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Bilinear(4, 3, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, a, b):
        return self.head(torch.tanh(self.first(a, b)))

model = Pair()
sample = (torch.randn(6, 4), torch.randn(6, 3))
"""


def test_sample_is_the_models_positional_inputs(tmp_path: Path) -> None:
    from profiler import profile_model

    # One tensor in a tuple is the nn.Sequential's one input, model(*sample).
    one = GOOD.replace("randn(6, 4)", "randn(6, 4),")
    model, sample = load_sequential(write(tmp_path, one))
    assert isinstance(sample, tuple) and len(sample) == 1
    assert len(profile_model(model, sample, warmup=0, repeats=1).layers) == 3
    # Two inputs: an nn.Sequential cannot take them; a model whose forward does is traced.
    two = GOOD.replace("randn(6, 4)", "randn(6, 4), torch.ones(6)")
    with pytest.raises(ModelFileError, match="nn.Sequential, which takes one input, but `sample`"):
        load_sequential(write(tmp_path, two))
    loaded = load_model_file(write(tmp_path, TWO_INPUTS))
    units, flat = as_sequential(loaded.model, loaded.sample)
    torch.testing.assert_close(units(*flat)[0], loaded.model(*loaded.sample))
    assert len(profile_model(units, flat, warmup=0, repeats=1).layers) == len(units)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'import torch\nname = "caf\xe9"\n', "is not UTF-8 Python source: byte 0xe9 on line 2"),
        (b"\xff\xfeimport torch\n", "is not UTF-8 Python source: byte 0xff on line 1"),
        (b"# coding: latin-1\nname = '\x81\x8d'\n\xff\xfe\x00", "it holds null bytes"),
    ],
)
def test_source_that_does_not_decode(tmp_path: Path, data: bytes, expected: str) -> None:
    path = tmp_path / "model.py"
    path.write_bytes(data)
    message = error_of(path)
    assert expected in message and str(path) in message
    assert "codec" not in message


def test_declared_encoding_is_read(tmp_path: Path) -> None:
    text = "# -*- coding: latin-1 -*-\n# café\n" + GOOD
    path = tmp_path / "model.py"
    path.write_bytes(text.encode("latin-1"))
    assert isinstance(load_model_file(path).model, nn.Sequential)


KWARGS_MODEL = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x, *, scale, shift=0.0):
        return self.b(self.a(x) * scale + shift)


model = Scaled()
sample = torch.randn(6, 4)
"""


@pytest.mark.parametrize(
    "kwargs",
    [
        'kwargs = {"scale": torch.full((6, 1), 3.0), "shift": 1.0}',
        'def kwargs():\n    return {"scale": torch.full((6, 1), 3.0), "shift": 1.0}',
    ],
)
def test_kwargs_reach_the_traced_model(tmp_path: Path, kwargs: str) -> None:
    path = write(tmp_path, KWARGS_MODEL + kwargs + "\n")
    loaded = load_model_file(path)
    assert set(loaded.kwargs) == {"scale", "shift"}
    assert len(load_sequential(path)[1]) == 2  # x and scale; the float is a constant
    layers, flat = as_sequential(loaded.model, loaded.sample, kwargs=loaded.kwargs)
    assert len(layers) == 2
    out = layers(*flat)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, loaded.model(loaded.sample, **loaded.kwargs))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ("kwargs = [1, 2]", "`kwargs` in {path} must be a dict of keyword inputs"),
        ("kwargs = {1: torch.ones(6)}", "must map argument names to inputs, got the key 1"),
        ('kwargs = {"scale": torch.ones(5, 1)}', "must have the sample's batch size 6 in dim 0"),
        ('kwargs = {"scale": torch.tensor(2.0)}', "got a 0-d tensor"),
        ("def kwargs(n):\n    return {}", "`kwargs` must be a value or a function taking no"),
    ],
)
def test_bad_kwargs(tmp_path: Path, kwargs: str, expected: str) -> None:
    path = write(tmp_path, KWARGS_MODEL + kwargs + "\n")
    assert expected.format(path=path) in error_of(path)


def test_sequential_takes_no_kwargs_or_tracing_options(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + 'kwargs = {"mask": torch.ones(6)}\n')
    assert "takes no keyword inputs" in error_of(path, sequential=True)
    with pytest.raises(ModelFileError, match="apply to traced models only"):
        load_sequential(write(tmp_path, GOOD, "plain.py"), granularity="leaves")


def test_tracing_advice_in_the_command_lines_words() -> None:
    from autopipe.cli.model_file import _as_options

    message = "mark it as a leaf (leaf_modules=['gate', 'a.b']) or granularity='children'"
    expected = "mark it as a leaf (--leaf-modules gate,a.b) or --granularity children"
    assert _as_options(message) == expected
