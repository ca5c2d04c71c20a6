"""Time and memory of one layer, already on its device, at one input batch."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from profiler.devices import synchronize
from profiler.gemm_inputs import GemmInputs, gemm_only
from profiler.precision import autocast_pass
from profiler.storages import storage_key

__all__ = ["state_storages", "storage_bytes", "storage_key"]


@dataclass
class LayerFigures:
    """One layer's figures at one batch size: seconds and bytes."""

    forward: float
    backward: float
    saved: int
    peak: int | None
    input_saved: int = 0  # of ``saved``: the input's storages
    output_saved: int = 0  # of ``saved``: the output's storages
    backward_input: float = 0.0  # of ``backward``: the input's gradient alone
    spread: float = 0.0  # of the forward and backward's runs: interquartile range / median
    gemm_saved: int = 0  # of ``saved``: the activation inputs of weight GEMMs
    output_grads: tuple[bool, ...] = ()  # which outputs require a gradient


class SavedBytes(NamedTuple):
    """What one forward saves for backward, de-duplicated by storage.

    Attributes:
        total: every saved byte but the layer's state.
        fresh: of ``total``, the newly allocated bytes (not the input's).
        of_output: of ``total``, the output's bytes.
        gemm: of ``total``, the activation operands of weight GEMMs that no other
            operation saves (:mod:`profiler.gemm_inputs`), each storage once.
    """

    total: int
    fresh: int
    of_output: int
    gemm: int


def as_tensors(value: Any, what: str) -> tuple[Tensor, ...]:
    """A layer's output (or a model input) as a tuple of tensors.

    Raises:
        ValueError: ``value`` is neither a tensor nor a tuple/list of tensors.
    """
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return tuple(value)
    raise ValueError(
        f"{what} is a {type(value).__name__}; expected a tensor or a non-empty tuple of tensors"
    )


class OneValue(nn.Module):
    """A layer called with its inputs as one tuple, as ``nn.Sequential`` passes a tuple."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *inputs: Tensor) -> Any:
        return self.layer(inputs)


def storage_bytes(tensors: list[Tensor], exclude: AbstractSet[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping those in ``exclude``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        key, nbytes = storage_key(tensor)
        if nbytes and key not in exclude:
            seen[key] = nbytes
    return sum(seen.values())


def tensor_bytes(tensors: tuple[Tensor, ...]) -> int:
    """Bytes of the tensors themselves, each distinct view counted once."""
    seen: dict[tuple[Any, ...], int] = {}
    for t in tensors:
        key = (storage_key(t)[0], t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


def state_storages(layer: nn.Module) -> set[int]:
    """Identities of the storages of a layer's parameters and buffers."""
    return {storage_key(t)[0] for t in (*layer.parameters(), *layer.buffers())}


def param_storages(layer: nn.Module) -> set[int]:
    """Identities of the storages of a layer's parameters."""
    return {storage_key(t)[0] for t in layer.parameters()}


def with_grad(tensor: Tensor, grad: bool) -> Tensor:
    """``tensor`` detached, requiring a gradient if ``grad`` and it can (floating)."""
    leaf = tensor.detach()
    if grad and (leaf.is_floating_point() or leaf.is_complex()):
        leaf.requires_grad_(True)
    return leaf


def _targets(outputs: tuple[Tensor, ...]) -> list[Tensor]:
    """The outputs backward starts from."""
    return [t for t in outputs if t.requires_grad and (t.is_floating_point() or t.is_complex())]


# Bytes written between timed passes to evict the caches: more than a CPU's last-level
# cache slice or a GPU's L2.
FLUSH_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}


def cache_bytes(device: torch.device) -> int | None:
    """The device's largest cache in bytes: a CPU's last-level cache (Linux sysfs), a
    GPU's L2; ``None`` when unknown."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or None
    if device.type != "cpu":
        return None
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def cold_cache_needed(working_set: int, device: torch.device) -> bool:
    """Whether a layer's data leaves the cache between its uses in a training step.

    A step runs every layer in turn, so between two uses of one layer's weights the
    others touch the model's working set (weights, gradients, activations). When that
    fits the device's largest cache, a layer finds its data still cached, as it does when
    timed alone over and over; when it does not, the layer reads from memory and timing it
    warm would flatter it. Unknown cache sizes count as too small.
    """
    size = cache_bytes(device)
    return size is None or working_set > size


class CacheFlush:
    """Evicts the device's caches by overwriting a scratch buffer larger than them.

    Inside a model, a layer's weights (and their gradients) were evicted by the layers
    that ran since it last touched them; timed alone, over and over, they stay in cache.
    Flushing before the forward and before the backward times each as in a real step.
    """

    def __init__(self, device: torch.device) -> None:
        size = FLUSH_BYTES.get(device.type, 0)
        self.buffer = torch.empty(size // 4, dtype=torch.float32, device=device) if size else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1.0)


class Pass:
    """Forward and backward passes of one layer on a fixed input, with fixed gradients."""

    def __init__(
        self,
        layer: nn.Module,
        inputs: tuple[Tensor, ...],
        device: torch.device,
        label: str,
        flush: CacheFlush | None = None,
        autocast: str | None = None,
        grads: Sequence[bool] | None = None,
    ):
        self.layer = layer
        self.label = label
        # A layer inside a model gets gradients for its floating inputs unless ``grads``
        # says which of them the model's earlier layers make require one (rotary tables
        # and masks computed from positions alone do not).
        wanted = [True] * len(inputs) if grads is None else list(grads)
        if len(wanted) != len(inputs):
            raise ValueError(f"got {len(wanted)} gradient flags for {len(inputs)} inputs")
        self.leaves = tuple(with_grad(t, g) for t, g in zip(inputs, wanted, strict=True))
        # Which outputs require a gradient, as the last forward found: what the next
        # layer's inputs require (:func:`with_grad`).
        self.output_grads: tuple[bool, ...] = ()
        self.device = device
        self.grads: list[Tensor] | None = None
        self.flush = flush or (lambda: None)
        # Without autocast a bare nullcontext: it adds nothing measurable to a timed pass.
        self.region: Callable[[], AbstractContextManager[None]] = (
            functools.partial(autocast_pass, device.type, autocast) if autocast else nullcontext
        )

    def arguments(self) -> tuple[Tensor, ...]:
        """Fresh copies of the inputs for one pass.

        Inside a model a layer's input is not a leaf, so in-place layers such as
        ``ReLU(inplace=True)`` may modify it; copies allow that and keep the stored
        inputs unchanged for the next pass.
        """
        for leaf in self.leaves:
            leaf.grad = None
        return tuple(leaf.clone() for leaf in self.leaves)

    def forward(self, args: tuple[Tensor, ...]) -> list[Tensor]:
        with self.region():
            outputs = as_tensors(self.layer(*args), f"the output of {self.label}")
        self.output_grads = tuple(t.requires_grad for t in outputs)
        targets = _targets(outputs)
        if self.grads is None:
            self.grads = [torch.ones_like(t) for t in targets]
        return targets

    def backward(self, targets: list[Tensor]) -> None:
        # Backward ops run in their forward's dtypes; autocast reaches only the ops a
        # backward calls itself (recomputed forwards, custom functions).
        if targets:
            with self.region():
                torch.autograd.backward(targets, self.grads)

    def run(self) -> None:
        self.backward(self.forward(self.arguments()))

    def timed(self) -> tuple[float, float]:
        """Seconds of one forward and one backward."""
        args = self.arguments()
        if self.device.type == "cuda":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            self.flush()
            events[0].record()
            targets = self.forward(args)
            events[1].record()
            self.flush()
            events[2].record()
            self.backward(targets)
            events[3].record()
            # Events time the GPU stream; wait until it has reached the last one.
            events[3].synchronize()
            backward = events[2].elapsed_time(events[3]) / 1e3 if targets else 0.0
            return events[0].elapsed_time(events[1]) / 1e3, backward
        self.flush()
        synchronize(self.device)
        t0 = time.perf_counter()
        targets = self.forward(args)
        synchronize(self.device)
        t1 = time.perf_counter()
        if not targets:
            return t1 - t0, 0.0
        self.flush()
        synchronize(self.device)
        t2 = time.perf_counter()
        self.backward(targets)
        synchronize(self.device)
        return t1 - t0, time.perf_counter() - t2

    def timed_input(self) -> float:
        """Seconds of a backward that computes the input's gradient only (no weights'), as
        zero-bubble schedules run it; 0 when no input takes a gradient."""
        args = self.arguments()
        targets = self.forward(args)
        wanted = [a for a in args if a.requires_grad]
        if not targets or not wanted:
            return 0.0
        self.flush()
        synchronize(self.device)
        start = time.perf_counter()
        with self.region():
            torch.autograd.grad(targets, wanted, self.grads, allow_unused=True)
        synchronize(self.device)
        return time.perf_counter() - start

    def saved(self, exclude: AbstractSet[int]) -> SavedBytes:
        """Bytes autograd saves for backward during one forward (then runs the backward)."""
        packed: list[Tensor] = []
        args = self.arguments()

        def pack(tensor: Tensor) -> Tensor:
            packed.append(tensor)
            return tensor

        gemms = GemmInputs(param_storages(self.layer))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), gemms:
            targets = self.forward(args)
        nbytes = storage_bytes(packed, exclude)
        fresh = storage_bytes(packed, {*exclude, *(storage_key(a)[0] for a in args)})
        outputs = {storage_key(t)[0] for t in targets}
        others = {storage_key(t)[0] for t in packed} - outputs
        of_output = storage_bytes(packed, {*exclude, *others})
        only = gemm_only(targets, gemms)
        inputs = [t for t in packed if storage_key(t)[0] in only]
        of_gemms = storage_bytes(inputs, exclude)
        packed.clear()
        del inputs
        self.backward(targets)
        return SavedBytes(nbytes, fresh, of_output, of_gemms)

    def peak(self, fresh: int) -> int:
        """CUDA memory above the baseline and the saved tensors during forward + backward.

        The baseline holds what exists before the layer runs (parameters, their
        gradients, the input), so only memory the layer allocates counts, less what
        stays behind as newly saved tensors (``fresh`` bytes).
        """
        args = self.arguments()
        synchronize(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.backward(self.forward(args))
        synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - baseline - fresh)


def measure_layer(
    layer: nn.Module,
    inputs: tuple[Tensor, ...],
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    label: str = "the layer",
    flush: CacheFlush | None = None,
    autocast: str | None = None,
    grads: Sequence[bool] | None = None,
) -> LayerFigures:
    """Measures one layer, already on ``device``, on ``inputs`` (also on ``device``).

    Args:
        layer: the module; its parameter gradients accumulate, so pass a copy.
        inputs: the layer's positional inputs; floating ones get ``requires_grad``
            (unless ``grads`` says otherwise).
        device: where ``layer`` and ``inputs`` live.
        warmup: untimed runs before the timed ones.
        repeats: timed runs; the median is reported.
        label: how error messages name the layer.
        flush: evicts the caches before each timed forward and backward, so weights are
            read as cold as in a whole step (``None``: warm caches).
        autocast: run every forward and backward under ``torch.autocast`` with this dtype
            (``bfloat16`` or ``float16``); ``None``: as the caller runs.
        grads: which inputs require a gradient, as the model's earlier layers made them
            (:attr:`LayerFigures.output_grads`); ``None``: every floating one.

    Returns:
        Median forward and backward seconds (and of a backward to the input alone), saved
        bytes and, on CUDA, the peak.
    """
    runs = Pass(layer, inputs, device, label, flush, autocast, grads)
    exclude = state_storages(layer)  # parameters and buffers are state, not saved
    # The first pass counts saved tensors and allocates parameter gradients, so the
    # later passes (and the peak) see gradients as existing state, not as transients.
    saved, fresh, of_output, of_gemms = runs.saved(exclude)
    for _ in range(warmup):
        runs.run()
    times = [runs.timed() for _ in range(repeats)]
    # Timed apart, after the whole backwards: its own passes do not disturb theirs.
    inputs_only = [runs.timed_input() for _ in range(repeats)]
    peak = runs.peak(fresh) if device.type == "cuda" else None
    return LayerFigures(
        spread=_spread([t[0] + t[1] for t in times]),
        forward=statistics.median(t[0] for t in times),
        backward=statistics.median(t[1] for t in times),
        saved=saved,
        peak=peak,
        input_saved=saved - fresh,
        output_saved=of_output,
        backward_input=statistics.median(inputs_only),
        gemm_saved=of_gemms,
        output_grads=runs.output_grads,
    )


def _spread(samples: list[float]) -> float:
    """Interquartile range over the median of ``samples`` (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    quartiles = statistics.quantiles(samples, n=4, method="inclusive")
    median = statistics.median(samples)
    return (quartiles[2] - quartiles[0]) / median if median > 0 else 0.0
