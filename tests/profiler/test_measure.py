"""Tests of the layer-by-layer profiler (profiler.measure) on CPU."""

from __future__ import annotations

import io
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from profiler import Profile, profile_layers, profile_model
from profiler.layer import measure_layer
from profiler.progress import TerminalProgress

FAST: dict[str, Any] = {"warmup": 1, "repeats": 3}
F32 = 4


class Split(nn.Module):
    """Returns two tensors, passed on as one tuple."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, x[:, :1] + 1


class Join(nn.Module):
    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a * b


class JoinPair(nn.Module):
    """Takes a tuple as its one argument, as nn.Sequential passes a tuple output on."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        return a * b


class Twice(nn.Module):
    """Returns the same tensor twice; it crosses a cut once."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = x + 1
        return y, y


class Shift(nn.Module):
    """Integer in, integer out: nothing to differentiate."""

    def forward(self, ids: Tensor) -> Tensor:
        return ids + 1


SEEN: list[Tensor] = []


class Record(nn.Module):
    """Remembers its inputs (in a module-level list, which deepcopy does not copy)."""

    def forward(self, x: Tensor) -> Tensor:
        SEEN.append(x.detach().clone())
        return x


class ReturnsDict(nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"x": x}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a busy machine, idle-waiting worker threads add noise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_more_flops_take_longer_and_time_grows_with_batch() -> None:
    layers = [nn.Linear(512, 512), nn.Linear(512, 8), nn.Linear(8, 8)]
    sample = torch.randn(32, 512)
    profile = profile_layers(layers, sample, batch_sizes=[32, 512], warmup=1, repeats=5)
    big, small = profile.layers[0], profile.layers[2]
    for i in range(2):
        assert big.forward[i] > small.forward[i]
        assert big.backward[i] > small.backward[i]
    assert big.forward[1] > big.forward[0]
    assert big.backward[1] > big.backward[0]
    assert profile.fit(0, "forward")[1] > 0
    assert profile.fit(0, "backward")[1] > 0


def test_saved_output_and_state_bytes_of_linear_relu_batchnorm() -> None:
    n_in, n_out = 6, 10
    model = nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU(), nn.BatchNorm1d(n_out))
    profile = profile_model(model, torch.randn(5, n_in), batch_sizes=[3, 5], **FAST)
    assert profile.batch_sizes == [3, 5]
    assert profile.input == [b * n_in * F32 for b in (3, 5)]
    linear, relu, norm = profile.layers
    assert linear.saved == [b * n_in * F32 for b in (3, 5)]  # the input; weight excluded
    assert relu.saved == [b * n_out * F32 for b in (3, 5)]  # the output
    assert linear.output == relu.output == [b * n_out * F32 for b in (3, 5)]
    assert linear.param_bytes == (n_in * n_out + n_out) * F32
    assert linear.buffer_bytes == relu.param_bytes == relu.buffer_bytes == 0
    assert norm.param_bytes == 2 * n_out * F32
    # running mean and variance, plus the int64 num_batches_tracked
    assert norm.buffer_bytes == 2 * n_out * F32 + 8
    # at least the input; the affine parameters are not counted
    assert all(s >= b * n_out * F32 for s, b in zip(norm.saved, (3, 5), strict=True))
    for layer in profile.layers:
        assert layer.peak is None
        assert all(t > 0 for t in layer.forward + layer.backward)


def test_profile_metadata() -> None:
    model = nn.Sequential(OrderedDict(first=nn.Linear(4, 4), act=nn.Tanh()))
    profile = profile_model(model, torch.randn(8, 4), chunks=2, **FAST)
    assert profile.names == ["first", "act"]
    assert [layer.kind for layer in profile.layers] == ["Linear", "Tanh"]
    assert profile.batch_size == 8
    assert profile.chunks == 2
    assert profile.device == "cpu"
    assert profile.device_name
    assert profile.torch_version == torch.__version__
    assert profile.dtype == "float32"


def test_dtype_without_parameters_comes_from_the_sample() -> None:
    floating = profile_layers([nn.ReLU()], torch.randn(2, 3, dtype=torch.float64), **FAST)
    assert floating.dtype == "float64"
    integer = profile_layers([Shift()], torch.arange(4).view(2, 2), **FAST)
    assert integer.dtype == "int64"


def test_model_is_left_untouched() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3)
    )
    model[4].eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    sample = torch.randn(6, 4)

    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    with torch.no_grad():  # the profiler still needs gradients inside
        profile = profile_model(model, sample, **FAST)

    assert torch.equal(torch.rand(1), expected)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert [m.training for m in model.modules()] == modes
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert not sample.requires_grad
    assert all(b > 0 for layer in profile.layers for b in layer.backward)


def test_existing_gradients_are_kept() -> None:
    layer = nn.Linear(3, 3)
    layer(torch.randn(2, 3)).sum().backward()
    assert layer.weight.grad is not None
    grad = layer.weight.grad.clone()
    profile_layers([layer], torch.randn(2, 3), **FAST)
    assert torch.equal(layer.weight.grad, grad)


def test_tuple_outputs_pass_on_as_one_value() -> None:
    # Between layers a tuple is one value, as nn.Sequential passes it.
    x = torch.randn(4, 3)
    nn.Sequential(Split(), JoinPair(), Twice())(x)
    profile = profile_layers([Split(), JoinPair(), Twice()], x, batch_sizes=[2, 4])
    split, join, twice = profile.layers
    assert split.output == [b * 3 * F32 + b * 1 * F32 for b in (2, 4)]
    assert join.output == [b * 3 * F32 for b in (2, 4)]
    assert twice.output == [b * 3 * F32 for b in (2, 4)]  # the same tensor twice, once
    assert all(t > 0 for t in join.backward)
    # A layer that takes the tuple's tensors as separate arguments fails in both alike.
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        nn.Sequential(Split(), Join())(x)
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        profile_layers([Split(), Join()], x, batch_sizes=[2, 4])


def test_tuple_sample() -> None:
    # profile_layers calls the first layer with the sample's inputs as arguments.
    sample = (torch.randn(4, 3), torch.randn(4, 1))
    profile = profile_layers([Join(), nn.Linear(3, 2)], sample, batch_sizes=[1, 4], **FAST)
    assert profile.input == [b * 4 * F32 for b in (1, 4)]
    assert profile.layers[1].output == [b * 2 * F32 for b in (1, 4)]


def test_sample_is_the_models_positional_inputs() -> None:
    x = torch.randn(4, 3)
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    one, single = (profile_model(model, s, batch_sizes=[2, 4], **FAST) for s in ((x,), x))
    assert one.input == single.input == [b * 3 * F32 for b in (2, 4)]
    assert one.layers[0].output == single.layers[0].output
    # nn.Sequential takes one input: model(a, b) has no plain call.
    a, b = torch.randn(4, 3), torch.randn(4, 1)
    with pytest.raises(ValueError, match=r"an nn.Sequential takes one input, not 2 \(the sample"):
        profile_model(nn.Sequential(Join(), nn.Linear(3, 2)), (a, b))
    # A first layer that takes a tuple gets it as the sample's one input, as in model((a, b)).
    pairwise = nn.Sequential(JoinPair(), nn.Linear(3, 2))
    pairwise((a, b))
    profile = profile_model(pairwise, ((a, b),), batch_sizes=[2, 4], **FAST)
    assert profile.input == [n * 4 * F32 for n in (2, 4)]
    assert profile.layers[0].output == [n * 3 * F32 for n in (2, 4)]

    class Both(nn.Sequential):  # a forward of its own takes both inputs
        def forward(self, a: Tensor, b: Tensor) -> Tensor:  # type: ignore[override]
            return self[1](self[0](a, b))

    both = profile_model(Both(Join(), nn.Linear(3, 2)), (a, b), batch_sizes=[2, 4], **FAST)
    assert both.layers[1].output == [n * 2 * F32 for n in (2, 4)]


def test_integer_inputs_get_no_gradient() -> None:
    ids = torch.randint(0, 50, (4, 7))
    layers = [Shift(), nn.Embedding(60, 16), nn.Linear(16, 2)]
    profile = profile_layers(layers, ids, batch_sizes=[2, 4], **FAST)
    shift, embed, _ = profile.layers
    assert profile.input == [b * 7 * 8 for b in (2, 4)]
    assert shift.backward == [0.0, 0.0]
    assert shift.saved == [0, 0]
    assert all(t > 0 for t in embed.backward)
    assert embed.saved == [b * 7 * 8 for b in (2, 4)]  # the int64 indices
    assert embed.output == [b * 7 * 16 * F32 for b in (2, 4)]


def test_backward_to_the_input_alone_is_timed() -> None:
    ids = torch.randint(0, 50, (4, 7))
    layers = [nn.Embedding(60, 16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 2)]
    profile = profile_layers(layers, ids, batch_sizes=[2, 4], **FAST)
    embed, *rest = profile.layers
    assert embed.backward_input == [0.0, 0.0]  # token ids take no gradient: all weights'
    for layer in rest:
        assert layer.backward_input is not None and len(layer.backward_input) == 2
        assert all(0 < i <= b for i, b in zip(layer.backward_input, layer.backward))
    again = Profile.from_dict(profile.to_dict())
    assert again.layers[1].backward_input == rest[0].backward_input
    old = profile.to_dict()
    for layer in old["layers"]:
        del layer["backward_input"]
    assert Profile.from_dict(old).layers[1].backward_input is None  # older profiles


def test_default_batch_sizes_follow_the_chunks() -> None:
    cases = {(8, 1): [4, 8], (8, 4): [1, 2], (8, 8): [1, 2], (7, 2): [2, 4], (1, 1): [1, 2]}
    for (batch, chunks), sizes in cases.items():
        profile = profile_layers([nn.ReLU()], torch.randn(batch, 2), chunks=chunks, **FAST)
        assert profile.batch_sizes == sizes, (batch, chunks)


def test_batch_sizes_beyond_the_sample_repeat_it() -> None:
    SEEN.clear()
    sample = torch.randn(2, 3)
    profile = profile_layers(
        [Record(), nn.Linear(3, 1)], sample, batch_sizes=[5, 1], repeats=1, count=False
    )
    assert profile.batch_sizes == [1, 5]
    assert profile.input == [1 * 3 * F32, 5 * 3 * F32]
    assert profile.layers[1].saved == [1 * 3 * F32, 5 * 3 * F32]
    assert profile.batch_size == 2
    assert any(torch.equal(x, sample[[0, 1, 0, 1, 0]]) for x in SEEN)
    assert any(torch.equal(x, sample[:1]) for x in SEEN)


@pytest.mark.parametrize(
    ("layers", "sample", "kwargs", "message"),
    [
        ([], torch.randn(2, 2), {}, "empty"),
        ([nn.ReLU()], torch.randn(2, 2), {"chunks": 0}, "chunks"),
        ([nn.ReLU()], "tensor", {}, "sample"),
        ([nn.ReLU()], (torch.randn(2, 2), 3), {}, "tuple of tensors"),
        ([nn.ReLU()], (), {}, "sample"),
        ([nn.ReLU()], torch.tensor(1.0), {}, "batch dimension"),
        ([nn.ReLU()], torch.randn(0, 3), {}, "empty batch"),
        ([Join()], (torch.randn(2, 3), torch.randn(3, 3)), {}, "disagree"),
        ([nn.ReLU()], torch.randn(2, 2), {"batch_sizes": [0, 2]}, "positive"),
        ([nn.ReLU()], torch.randn(2, 2), {"batch_sizes": [2, 2]}, "distinct"),
        ([nn.ReLU()], torch.randn(2, 2), {"names": ["a", "b"]}, "names"),
        ([nn.ReLU()], torch.randn(2, 2), {"repeats": 0}, "repeats"),
        ([lambda x: x], torch.randn(2, 2), {}, "nn.Module"),
        ([ReturnsDict()], torch.randn(2, 2), {}, "output of layer 0"),
        ([nn.ReLU()], torch.randn(2, 2), {"autocast": "fp8"}, "autocast must be bfloat16 or"),
        ([nn.ReLU()], torch.randn(2, 2), {"autocast": torch.bfloat16}, "got torch.bfloat16"),
        ([nn.ReLU()], torch.randn(2, 2), {"autocast": "float32"}, "got 'float32'"),
    ],
)
def test_bad_input_raises(layers: list, sample: object, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        profile_layers(layers, sample, **kwargs)  # type: ignore[arg-type]


def test_profile_model_needs_a_sequential() -> None:
    with pytest.raises(ValueError, match=r"nn\.Sequential"):
        profile_model(nn.Linear(2, 2), torch.randn(2, 2))  # type: ignore[arg-type]


def test_progress_called_once_per_layer() -> None:
    calls: list[tuple[int, int, str]] = []
    model = nn.Sequential(OrderedDict(a=nn.Linear(2, 2), b=nn.ReLU(), c=nn.Linear(2, 1)))
    profile_model(model, torch.randn(2, 2), progress=lambda *args: calls.append(args), repeats=1)
    assert calls == [(1, 3, "a"), (2, 3, "b"), (3, 3, "c")]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_progress_rewrites_one_line_on_a_tty_only() -> None:
    pipe = io.StringIO()
    TerminalProgress(pipe)(1, 2, "0")
    assert pipe.getvalue() == ""

    tty = FakeTerminal()
    show = TerminalProgress(tty, kinds={"10": "Linear"})
    show(1, 12, "10")
    show(12, 12, "x")
    text = tty.getvalue()
    assert text.startswith("\rprofiling layer 1/12 (10: Linear)\r")
    assert "profiling layer 12/12 (x)" in text
    assert text.endswith("\n") and text.count("\n") == 1


def test_measured_profile_survives_json(tmp_path: object) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    profile = profile_model(model, torch.randn(4, 3), **FAST)
    path = f"{tmp_path}/profile.json"
    profile.save(path)
    assert Profile.load(path) == profile


def test_in_place_layers() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))
    profile = profile_model(model, torch.randn(4, 3), batch_sizes=[2, 4], **FAST)
    relu = profile.layers[1]
    assert relu.saved == [b * 5 * F32 for b in (2, 4)]  # its output, which is its input
    assert all(t > 0 for t in relu.backward)


class FakeEvent:
    """Stands in for torch.cuda.Event on a machine without CUDA."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.time = 0.0

    def record(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1e3


def test_cuda_code_path_with_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5000)
    layer = nn.Linear(4, 4)
    figures = measure_layer(layer, (torch.randn(3, 4),), torch.device("cuda"), **FAST)
    assert figures.forward > 0 and figures.backward > 0
    assert figures.saved == 3 * 4 * F32
    # the saved input existed before the pass, so only the allocations above it count
    assert figures.peak == 4000
    relu = measure_layer(nn.ReLU(), (torch.randn(3, 4),), torch.device("cuda"), **FAST)
    assert relu.peak == 4000 - 3 * 4 * F32  # the saved output is not transient


def test_cache_flush_overwrites_a_large_buffer_and_can_be_turned_off() -> None:
    from profiler.layer import FLUSH_BYTES, CacheFlush

    flush = CacheFlush(torch.device("cpu"))
    assert flush.buffer is not None
    assert flush.buffer.numel() * 4 == FLUSH_BYTES["cpu"]
    flush.buffer.zero_()
    flush()
    assert bool((flush.buffer == 1.0).all())
    assert CacheFlush(torch.device("meta")).buffer is None
    layers = [nn.Linear(8, 8), nn.ReLU()]
    warm = profile_layers(layers, torch.randn(4, 8), cold_cache=False, **FAST)
    cold = profile_layers(layers, torch.randn(4, 8), **FAST)
    assert [p.saved for p in warm.layers] == [p.saved for p in cold.layers]
    assert all(t > 0 for p in cold.layers for t in p.forward)


# ----------------------------------------------------------------------------------------
# Mixed precision.

BF16 = 2


PHASES: list[tuple[str, torch.dtype | None]] = []


def _autocast_dtype() -> torch.dtype | None:
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        PHASES.append(("backward", _autocast_dtype()))
        return grad


class AutocastProbe(nn.Module):
    """Records whether autocast is on in its forward and backward (in a module-level list,
    which deepcopy does not copy)."""

    def forward(self, x: Tensor) -> Tensor:
        PHASES.append(("forward", _autocast_dtype()))
        out: Tensor = _Probe.apply(x)
        return out


def _linear_gelu(width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_halves_the_saved_activations(dtype: str) -> None:
    width, sizes = 32, [256, 512]
    model, sample = _linear_gelu(width), torch.randn(512, width)
    full = profile_model(model, sample, batch_sizes=sizes, **FAST)
    half = profile_model(model, sample, batch_sizes=sizes, autocast=dtype, **FAST)
    assert full.autocast is None and half.autocast == dtype
    assert half.dtype == "float32"  # the parameters stay float32; only the compute is not
    for f32, low in zip(full.layers, half.layers, strict=True):
        assert low.output == [b * width * BF16 for b in sizes] == [o // 2 for o in f32.output]
        assert low.param_bytes == f32.param_bytes
    linear, gelu = half.layers[2], half.layers[3]
    assert gelu.saved == [s // 2 for s in full.layers[3].saved]  # its half-precision input
    # A linear saves its input and its weight, both cast: the weight copy is fixed.
    assert linear.saved == [b * width * BF16 + width * width * BF16 for b in sizes]
    ratio = sum(sum(layer.saved) for layer in half.layers) / sum(
        sum(layer.saved) for layer in full.layers
    )
    assert 0.45 < ratio < 0.6


def test_autocast_covers_every_forward_and_backward() -> None:
    PHASES.clear()
    layers = [nn.Linear(4, 4), AutocastProbe()]
    profile = profile_layers(layers, torch.randn(4, 4), autocast="bfloat16", **FAST)
    assert profile.autocast == "bfloat16"
    assert {phase for phase, _ in PHASES} == {"forward", "backward"}
    assert all(dtype == torch.bfloat16 for _, dtype in PHASES)
    assert not torch.is_autocast_enabled("cpu")  # the caller's state is left as it was


def test_the_callers_autocast_is_recorded_and_an_explicit_one_wins() -> None:
    layers = [nn.Linear(4, 4)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inherited = profile_layers(layers, torch.randn(4, 4), **FAST)
        explicit = profile_layers(layers, torch.randn(4, 4), autocast="float16", **FAST)
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert inherited.autocast == "bfloat16"
    assert explicit.autocast == "float16"
    assert inherited.layers[0].output == [b * 4 * BF16 for b in inherited.batch_sizes]


def test_autocast_profile_survives_json(tmp_path: object) -> None:
    profile = profile_model(_linear_gelu(8), torch.randn(4, 8), autocast="bfloat16", **FAST)
    path = f"{tmp_path}/profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert Profile.load(path).autocast == "bfloat16"


def test_the_profile_reports_its_timing_spread() -> None:
    from profiler.layer import _spread

    assert _spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert _spread([2.0]) == 0.0 and _spread([0.0, 0.0]) == 0.0
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    profile = profile_model(model, torch.randn(8, 8), repeats=5, warmup=1, chunks=2)
    assert 0.0 <= profile.meta["spread"] < 10.0
    one = profile_model(model, torch.randn(8, 8), repeats=1, warmup=0, chunks=2)
    assert one.meta["spread"] == 0.0  # one run per layer: no spread to tell


def test_caches_are_flushed_only_for_a_working_set_larger_than_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import profiler.measure as measure

    layers = [nn.Linear(8, 8), nn.ReLU()]
    weights = 2 * (8 * 8 + 8) * 4  # the Linear's parameters and their gradients
    monkeypatch.setattr(measure, "cache_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(
        measure, "cold_cache_needed", lambda working_set, device: working_set > 1 << 20
    )
    warm = profile_layers(layers, torch.randn(4, 8), **FAST)
    cache = warm.meta["cache"]
    assert cache["cold"] is False and cache["cache_bytes"] == 1 << 20
    saved = sum(max(layer.saved) for layer in warm.layers)
    assert cache["working_set"] == weights + saved
    monkeypatch.setattr(measure, "cold_cache_needed", lambda working_set, device: True)
    cold = profile_layers(layers, torch.randn(4, 8), **FAST)
    assert cold.meta["cache"]["cold"] is True
    explicit = profile_layers(layers, torch.randn(4, 8), cold_cache=True, **FAST)
    assert "cache" not in explicit.meta  # a caller's choice is not recorded as automatic


def test_cold_cache_needed_compares_with_the_largest_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import profiler.layer as layer

    cpu = torch.device("cpu")
    monkeypatch.setattr(layer, "cache_bytes", lambda device: 32 << 20)
    assert not layer.cold_cache_needed(9 << 20, cpu)
    assert layer.cold_cache_needed(59 << 20, cpu)
    monkeypatch.setattr(layer, "cache_bytes", lambda device: None)
    assert layer.cold_cache_needed(1, cpu)  # unknown: flushed, as before


def test_cache_bytes_reads_the_largest_cpu_cache() -> None:
    from profiler.layer import cache_bytes

    found = cache_bytes(torch.device("cpu"))
    assert found is None or found >= 1 << 10
    assert cache_bytes(torch.device("meta")) is None


class Positions(nn.Module):
    """Passes its input on beside a table computed from a buffer alone, as rotary
    embeddings' cosines are: nothing in the table requires a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(3))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, self.table.expand(x.shape[0], 3).clone()


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        x, table = pair
        return self.linear(x) * table


@pytest.mark.parametrize("measure", [True, False])
def test_an_input_that_needs_no_gradient_is_not_given_one(measure: bool) -> None:
    # The product saves the table (for the linear output's gradient) but not the linear
    # output, which only the table's gradient would need: the table depends on no
    # parameter, as in the model, so it needs none (a layer's first inputs still get one).
    x = torch.randn(4, 3)
    profile = profile_layers([Positions(), Mix()], x, batch_sizes=[2, 4], measure=measure)
    mix = profile.layers[1]
    assert mix.saved == [2 * b * 3 * F32 for b in (2, 4)]  # the linear's input and the table
    # First, the same layer gets gradients for every floating input: the output is saved.
    first = profile_layers([Mix()], ((x, x),), batch_sizes=[2, 4], measure=measure)
    assert first.layers[0].saved == [3 * b * 3 * F32 for b in (2, 4)]
