"""Counted bytes equal measured ones, model by model; FLOPs and traffic of simple layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.cli.model_file import load_split
from profiler.measure import profile_layers
from tests.support.counted import byte_differences, counted_and_measured
from tests.support.paths import EXAMPLES


def _example(path: Path) -> tuple[nn.Sequential, Any]:
    _, layers, flat = load_split(path)
    return layers, flat if isinstance(flat, Tensor) else tuple(flat)


def _small_gpt2_file(tmp_path: Path) -> Path:
    """The GPT-2 example with 2 blocks instead of 12: the same units, quicker to trace."""
    file = tmp_path / "gpt2_small.py"
    file.write_text(
        "import runpy\n"
        f"_example = runpy.run_path({str(EXAMPLES / 'gpt2.py')!r})\n"
        "def model():\n    return _example['model'](2)\n"
        "sample = _example['sample']\n"
    )
    return file


@pytest.mark.parametrize("name", ["mlp", "convnet", "gpt2"])
def test_examples_count_what_they_measure(name: str, tmp_path: Path) -> None:
    path = _small_gpt2_file(tmp_path) if name == "gpt2" else EXAMPLES / f"{name}.py"
    layers, sample = _example(path)
    counted, measured = counted_and_measured(layers, sample, chunks=2)
    assert byte_differences(counted, measured) == {}
    assert counted.meta["unmeasured"] and "unmeasured" not in measured.meta
    assert sum(sum(layer.saved) for layer in counted.layers) > 0


class _Pair(nn.Module):
    """Returns a tuple, the same tensor twice among it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = self.a(x).relu()
        return h, self.b(x), h


class _Join(nn.Module):
    """Takes the tuple as one value; passes one tensor on and adds a new one."""

    def forward(self, pair: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        a, b, c = pair
        return a, c, a[:, :8] * b


class _Last(nn.Module):
    def forward(self, triple: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        return triple[0] + triple[1] + triple[2].repeat(1, 2)


class _Residual(nn.Module):
    """Saves its input for backward (the product with ``x``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.linear(x)) * x


class _Recurrent(nn.Module):
    """A batch-first LSTM's output sequence: transposed, not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 16, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.lstm(x)[0]


class _Attention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        shape = (batch, length, 3, self.heads, width // self.heads)
        q, k, v = self.qkv(x).view(shape).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class _Normalized(nn.Module):
    """Batch, group and layer norm on one convolution's output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.batch = nn.BatchNorm2d(8)
        self.group = nn.GroupNorm(2, 8)
        self.layer = nn.LayerNorm(6)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(self.group(self.batch(self.conv(x)).relu()))


Case = Callable[[], tuple[list[nn.Module], Tensor, dict[str, Any]]]


def _inplace_relu() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    layers = [nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True)]
    return layers, torch.randn(8, 16), {}


def _tuples() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    return [nn.Linear(16, 16), _Pair(), _Join(), _Last()], torch.randn(8, 16), {}


def _residual() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    return [nn.Linear(16, 16), _Residual(), _Residual(), nn.Linear(16, 4)], torch.randn(8, 16), {}


def _batchnorm_train() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    layers = [nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(288, 4)]
    return layers, torch.randn(4, 3, 8, 8), {}


def _attention() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    return [nn.Linear(32, 32), _Attention(), nn.LayerNorm(32)], torch.randn(4, 16, 32), {}


def _autocast_bfloat16() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    # Norms under autocast keep float32 weights and, on the CPU, float32 statistics.
    layers = [_Normalized(), nn.Flatten(2), nn.Linear(36, 32), _Attention(), nn.LayerNorm(32)]
    return layers, torch.randn(4, 3, 8, 8), {"autocast": "bfloat16"}


def _float64() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), _Residual(), nn.LayerNorm(16)).double()
    return list(model), torch.randn(8, 16, dtype=torch.float64), {}


def _embedding_bags() -> tuple[list[nn.Module], Tensor, dict[str, Any]]:
    # The CPU kernel's offset2bag, saved for backward, has one element more than it shows.
    layers = [_Bags(nn.EmbeddingBag(50, 8, mode="mean"), nn.EmbeddingBag(50, 8, mode="max"))]
    return [*layers, nn.Linear(16, 4)], torch.randint(0, 50, (4, 5)), {}


class _Bags(nn.Module):
    def __init__(self, *bags: nn.EmbeddingBag) -> None:
        super().__init__()
        self.bags = nn.ModuleList(bags)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.cat([bag(ids) for bag in self.bags], dim=1)


CASES: dict[str, Case] = {
    "inplace-relu": _inplace_relu,
    "tuples": _tuples,
    "residual": _residual,
    "batchnorm-train": _batchnorm_train,
    "attention": _attention,
    "autocast-bfloat16": _autocast_bfloat16,
    "float64": _float64,
    "embedding-bags": _embedding_bags,
}


@pytest.mark.parametrize("name", list(CASES))
def test_awkward_models_count_what_they_measure(name: str) -> None:
    torch.manual_seed(0)
    layers, sample, kwargs = CASES[name]()
    counted, measured = counted_and_measured(layers, sample, batch_sizes=[2, 4], **kwargs)
    assert byte_differences(counted, measured) == {}


class _Workspace(TorchDispatchMode):
    """Sums the workspace bytes of oneDNN's LSTM layers (their fourth result)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default:
            self.bytes += out[3].numel() * out[3].element_size()
        return out


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_lstm_saves_onednns_workspace_which_a_count_cannot_see(autocast: str | None) -> None:
    # The CPU LSTM runs oneDNN's kernel, which saves a workspace for backward whose size
    # oneDNN alone knows; the fake kernel returns it empty. Everything else matches.
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), _Recurrent(), nn.Linear(16, 4)]
    sample = torch.randn(4, 10, 16)
    sizes = [2, 4]
    counted, measured = counted_and_measured(layers, sample, batch_sizes=sizes, autocast=autocast)
    workspace = []
    for size in sizes:
        spy = _Workspace()
        x = torch.randn(size, 10, 16, requires_grad=True)
        enabled = autocast is not None
        with spy, torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            layers[1](x)
        workspace.append(spy.bytes)
    lstm = "1.saved"
    differences = byte_differences(counted, measured)
    assert list(differences) == ([lstm] if any(workspace) else [])
    if any(workspace):
        ours, theirs = differences[lstm]
        assert [m - c for c, m in zip(ours, theirs, strict=True)] == workspace
    # The next layer copies the transposed sequence it gets: it saves none of it.
    assert counted.layers[2].shared == measured.layers[2].shared == [0, 0]


def _counted(layers: list[nn.Module], sample: Tensor, size: int) -> list[Any]:
    return profile_layers(layers, sample, batch_sizes=[size], measure=False).layers


def test_linear_flops() -> None:
    n, a, b = 5, 8, 6
    (linear,) = _counted([nn.Linear(a, b)], torch.randn(n, a), n)
    assert linear.flops == [2 * n * a * b]
    assert linear.backward_flops == [4 * n * a * b]
    assert linear.backward_input_flops == [2 * n * a * b]


def test_conv2d_flops() -> None:
    n, cin, cout, k, size = 2, 3, 4, 3, 9
    conv = nn.Conv2d(cin, cout, k, stride=2, padding=1)
    (layer,) = _counted([conv], torch.randn(n, cin, size, size), n)
    out = (size + 2 * 1 - k) // 2 + 1
    forward = 2 * n * cout * out * out * cin * k * k
    assert layer.flops == [forward]
    # The input's gradient and the weight's: a convolution each.
    assert layer.backward_flops == [2 * forward]
    assert layer.backward_input_flops == [forward]


def test_relu_traffic_is_its_input_and_output() -> None:
    n, d = 5, 6
    (relu,) = _counted([nn.ReLU()], torch.randn(n, d), n)
    assert relu.traffic == [2 * n * d * 4]
    # Backward reads the gradient and the output and writes the input's gradient.
    assert relu.backward_traffic == [3 * n * d * 4]
    assert relu.flops == [0]


class _Transpose(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(0, 1)


def test_views_move_no_bytes() -> None:
    layers = [nn.Flatten(), _Transpose(), nn.Unflatten(0, (2, 3))]
    profile = profile_layers(layers, torch.randn(5, 2, 3), batch_sizes=[5], measure=False)
    assert [layer.traffic for layer in profile.layers] == [[0], [0], [0]]
    # A copy is not a view: a reshape of the transposed tensor moves it.
    (copy,) = _counted([nn.Sequential(_Transpose(), nn.Flatten(0))], torch.randn(5, 6), 5)
    assert copy.traffic == [2 * 5 * 6 * 4]
