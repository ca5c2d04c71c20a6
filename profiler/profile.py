"""Per-layer measurements of a model as plain data, saved as versioned JSON."""

from __future__ import annotations

import itertools
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import numpy as np

from profiler.expert_counts import ExpertCounts
from profiler.fit import fit_linear, segments
from profiler.jsonfile import read_json, write_json
from profiler.precision import check_autocast
from profiler.shard_counts import ShardCounts

__all__ = ["PROFILE_VERSION", "LayerProfile", "Profile", "TiedState"]

PROFILE_VERSION = 1


@dataclass
class LayerProfile:
    """What one layer costs, measured at each profiled micro-batch size.

    Lists run parallel to :attr:`Profile.batch_sizes`. Times are seconds (median of the
    repeats), sizes are bytes.

    Attributes:
        name: the layer's name in the model (its index in an ``nn.Sequential``).
        kind: the layer's class name.
        forward: forward time per batch size.
        backward: backward time per batch size (gradients of inputs and parameters).
        saved: bytes the layer saves for backward, de-duplicated by storage, parameters
            and buffers excluded.
        output: bytes of the layer's output, what crosses a cut placed after it.
        param_bytes: bytes of the layer's parameters.
        buffer_bytes: bytes of the layer's buffers (e.g. BatchNorm running statistics).
        peak: transient memory above the saved tensors during forward and backward, when
            the device can report it (CUDA), else ``None``.
        shared: of ``saved``, the bytes of the layer's input that the layer before it also
            saves (as its output): one storage, held once by a stage that keeps both
            layers. ``None`` (older profiles) counts as zero.
        backward_input: of ``backward``, the seconds of the input's gradient alone (the
            rest computes the weights' gradients, which zero-bubble schedules run apart).
            ``None`` (older profiles): unknown.
        flops: floating-point operations of the forward per batch size, as
            ``torch.utils.flop_counter`` counts them (a multiply-add is two); ``None``: not
            counted.
        backward_flops: the same for the backward (input and weight gradients).
        backward_input_flops: of ``backward_flops``, those of the input's gradient alone.
        traffic: bytes the forward's operations read and write (each operation's tensor
            inputs and outputs, what a kernel without fusion moves through memory); ``None``:
            not counted.
        backward_traffic: the same for the backward.
        operations: operations of the forward that move bytes (kernel launches, each with a
            fixed cost that small layers are bound by); ``None``: not counted.
        backward_operations: the same for the backward.
        shards: what tensor and context parallelism divide of the layer and what they
            communicate (:class:`profiler.shard_counts.ShardCounts`); ``None``: counted
            without a tensor-parallel plan.
        experts: what expert parallelism divides of the layer's routed experts and what it
            sends (:class:`profiler.expert_counts.ExpertCounts`); ``None``: no routed
            experts.
        gemm_saved: of ``saved``, the bytes that are the activation operand of a GEMM with
            a weight (:mod:`profiler.gemm_inputs`), each storage once: what an FP8 recipe
            saves in one byte per element. ``None`` (older profiles): unknown.
        norm_saved: of ``saved``, the bytes that are outputs of the layer's normalization
            modules (``LayerNorm``, ``RMSNorm``; :mod:`profiler.norm_counting`): what
            re-computing the norms in the backward frees per micro-batch. ``None``: not
            counted.
        norm_flops: of ``flops``, the normalization modules' own: what re-computing them
            runs again in the backward.
        norm_traffic: of ``traffic``, the same.
        norm_operations: of ``operations``, the same.
        up_proj_saved: of ``saved``, the bytes a latent attention's up-projections and
            what follows them make for the attention (queries, keys, values;
            :mod:`profiler.up_projection_counting`): what re-computing the up-projections
            in the backward (Megatron-LM's ``mla_up_proj``) frees per micro-batch.
            ``None``: not counted.
        up_proj_flops: of ``flops``, that region's own: what re-computing it runs again.
        up_proj_traffic: of ``traffic``, the same.
        up_proj_operations: of ``operations``, the same.
        rebuilt: bytes the backward re-builds before it runs, from what the layer keeps:
            no part of ``saved`` (which no longer holds them), set when planning
            re-computes part of the layer (its norms: ``autopipe.planning``'s
            ``recompute_norms``). They live while the backward runs, and under a schedule
            that splits it, from the input gradient's pass until the weights'. ``None``:
            nothing is re-built.
    """

    name: str
    kind: str
    forward: list[float]
    backward: list[float]
    saved: list[int]
    output: list[int]
    param_bytes: int = 0
    buffer_bytes: int = 0
    peak: list[int] | None = None
    shared: list[int] | None = None
    backward_input: list[float] | None = None
    flops: list[float] | None = None
    backward_flops: list[float] | None = None
    backward_input_flops: list[float] | None = None
    traffic: list[float] | None = None
    backward_traffic: list[float] | None = None
    operations: list[float] | None = None
    backward_operations: list[float] | None = None
    shards: ShardCounts | None = None
    experts: ExpertCounts | None = None
    gemm_saved: list[int] | None = None
    norm_saved: list[int] | None = None
    norm_flops: list[float] | None = None
    norm_traffic: list[float] | None = None
    norm_operations: list[float] | None = None
    up_proj_saved: list[int] | None = None
    up_proj_flops: list[float] | None = None
    up_proj_traffic: list[float] | None = None
    up_proj_operations: list[float] | None = None
    rebuilt: list[int] | None = None

    @property
    def state_bytes(self) -> int:
        """Parameters plus buffers."""
        return self.param_bytes + self.buffer_bytes


_TIMES = "times must be finite numbers of seconds >= 0"
_BYTES = "byte counts must be finite numbers >= 0"
_LAYER_TIMES = ("forward", "backward", "backward_input")
_LAYER_BYTES = (
    "saved",
    "output",
    "peak",
    "shared",
    "gemm_saved",
    "norm_saved",
    "up_proj_saved",
    "rebuilt",
)
_LAYER_COUNTS = (
    "flops",
    "backward_flops",
    "backward_input_flops",
    "traffic",
    "backward_traffic",
    "operations",
    "backward_operations",
    "norm_flops",
    "norm_traffic",
    "norm_operations",
    "up_proj_flops",
    "up_proj_traffic",
    "up_proj_operations",
)
_COUNTS = "operation and byte counts must be finite numbers >= 0"


@dataclass
class TiedState:
    """A parameter (or buffer) that several layers use: one tensor, counted in each.

    Every user's :attr:`LayerProfile.param_bytes` (or ``buffer_bytes``) includes it; a
    stage holding several of them holds it once.

    Attributes:
        names: its names in the model, the first one first (``lm_head.weight`` and
            ``transformer.wte.weight`` for GPT-2's tied head).
        layers: the indices of the layers that use it, ascending.
        bytes: its size.
        buffer: a buffer (no gradient, no optimizer state), not a parameter.
        unsplit: its users must lie in one stage: some user writes it in place during
            forward (a running statistic, a counter) and the runner would give each stage
            a copy of its own, which would drift apart. The runner sets it; the planner
            then cuts nowhere between its first and its last user.
    """

    names: list[str]
    layers: list[int]
    bytes: int
    buffer: bool = False
    unsplit: bool = False


def _check_count(value: object, where: str, what: str) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} is {value!r}; {what} must be an integer >= 1")


def _check_amount(value: object, where: str, rule: str) -> None:
    number = float(value) if isinstance(value, numbers.Real) else math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{where} is {value!r}; {rule}")


def _check_figures(values: object, where: str, n: int, rule: str) -> None:
    """One figure per batch size, each finite and non-negative."""
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != n:
        raise ValueError(f"{where} must be a list of one figure per batch size ({n})")
    for j, value in enumerate(values):
        _check_amount(value, f"{where}[{j}]", rule)


def _check_layer(layer: LayerProfile, where: str, n: int) -> None:
    """Validates one layer's figures against ``n`` batch sizes (``where`` names it)."""
    for what in ("name", "kind"):
        if not isinstance(getattr(layer, what), str):
            raise ValueError(f"{where}.{what} must be a string, got {getattr(layer, what)!r}")
    checks = ((_LAYER_TIMES, _TIMES), (_LAYER_BYTES, _BYTES), (_LAYER_COUNTS, _COUNTS))
    for figures, rule in checks:
        for what in figures:
            values = getattr(layer, what)
            if values is not None or what in ("forward", "backward", "saved", "output"):
                _check_figures(values, f"{where}.{what}", n, rule)
    for what in ("param_bytes", "buffer_bytes"):
        _check_amount(getattr(layer, what), f"{where}.{what}", _BYTES)
    for what in ("gemm_saved", "norm_saved", "up_proj_saved"):
        parts = getattr(layer, what)
        for j, (part, whole) in enumerate(zip(parts or [], layer.saved, strict=False)):
            if part > whole:
                raise ValueError(
                    f"{where}.{what}[{j}] is {part!r}, more than the {whole!r} bytes the "
                    "layer saves; it is a part of them"
                )
    if layer.shards is not None:
        if not isinstance(layer.shards, ShardCounts):
            raise ValueError(f"{where}.shards must be a ShardCounts, got {layer.shards!r}")
        layer.shards.check(f"{where}.shards", n)
    if layer.experts is not None:
        if not isinstance(layer.experts, ExpertCounts):
            raise ValueError(f"{where}.experts must be an ExpertCounts, got {layer.experts!r}")
        layer.experts.check(f"{where}.experts", n)


# What a figure may sum to over the layers. Planning multiplies sums by micro-batch, stage
# and replica counts; far below the float maximum, they stay finite (1e200 seconds or
# bytes is no measurement).
_SUM_LIMIT = 1e200


def _check_sums(layers: Sequence[LayerProfile]) -> None:
    """Every figure summed over the layers stays finite through planning's arithmetic."""
    for what in (*_LAYER_TIMES, *_LAYER_BYTES, *_LAYER_COUNTS, "param_bytes", "buffer_bytes"):
        found = [getattr(layer, what) for layer in layers]
        rows = [[v] if isinstance(v, numbers.Real) else v for v in found if v is not None]
        total = sum(max(float(x) for x in row) for row in rows if row)
        if not total < _SUM_LIMIT:
            raise ValueError(
                f"layers[*].{what} sums to {total:g} over the layers, beyond the {_SUM_LIMIT:g} "
                "a profile's figures can be planned with; the profile is corrupt: profile again"
            )


def _check_fields(kind: type, data: dict[str, Any], where: str) -> None:
    """Every field the dataclass ``kind`` requires is in ``data``, and no other."""
    known = {f.name: f for f in fields(kind)}
    for name in data:
        if name not in known:
            raise ValueError(f"not a valid autopipe profile: {where} has unknown field {name!r}")
    for name, spec in known.items():
        required = spec.default is MISSING and spec.default_factory is MISSING
        if required and name not in data:
            raise ValueError(f"not a valid autopipe profile: {where} lacks field {name!r}")


def _check_tied(tied: object, n: int) -> None:
    """Each tied entry names itself, lists two or more distinct layers and has a size."""
    if not isinstance(tied, list):
        raise ValueError(f"tied must be a list, got {tied!r}")
    for i, item in enumerate(tied):
        where = f"tied[{i}]"
        if not isinstance(item, TiedState):
            raise ValueError(f"{where} must be a TiedState, got {item!r}")
        names = item.names
        if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
            raise ValueError(f"{where}.names must be a non-empty list of strings, got {names!r}")
        layers = item.layers
        ok = isinstance(layers, list) and all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k < n for k in layers
        )
        if not ok or len(layers) < 2 or any(a >= b for a, b in itertools.pairwise(layers)):
            raise ValueError(
                f"{where}.layers is {layers!r}; it must list two or more ascending layer "
                f"indices below {n}"
            )
        _check_amount(item.bytes, f"{where}.bytes", _BYTES)
        if not isinstance(item.buffer, bool):
            raise ValueError(f"{where}.buffer must be true or false, got {item.buffer!r}")
        if not isinstance(item.unsplit, bool):
            raise ValueError(f"{where}.unsplit must be true or false, got {item.unsplit!r}")


@dataclass
class Profile:
    """Measurements of every layer of a model on one device.

    Attributes:
        layers: per-layer figures, in execution order.
        batch_sizes: the micro-batch sizes every layer was measured at.
        input: bytes of the model's input at each batch size.
        batch_size: the mini-batch size the profile was made for.
        chunks: the micro-batch count the profile was made for.
        device: the device string, e.g. ``cuda:0``.
        device_name: a human name of the device (GPU model or CPU).
        torch_version: the torch version that measured.
        dtype: the floating dtype of the parameters.
        version: the JSON schema version.
        meta: further measurements (``pooled`` groups, ``calibration``).
        autocast: the ``torch.autocast`` dtype every forward and backward ran under
            (``bfloat16`` or ``float16``), ``None`` without autocast (and in profiles
            saved before it was recorded).
        tied: the parameters and buffers several layers use (empty in profiles saved
            before they were recorded, and written only when there are some).
    """

    layers: list[LayerProfile]
    batch_sizes: list[int]
    input: list[int]
    batch_size: int
    chunks: int = 1
    device: str = "cpu"
    device_name: str = ""
    torch_version: str = ""
    dtype: str = "float32"
    version: int = PROFILE_VERSION
    meta: dict[str, Any] = field(default_factory=dict)
    autocast: str | None = None
    tied: list[TiedState] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, Sequence) or not self.layers:
            raise ValueError("a profile needs at least one layer")
        check_autocast(self.autocast)
        sizes = self.batch_sizes
        if not isinstance(sizes, Sequence) or not sizes:
            raise ValueError(f"batch_sizes must be a non-empty list of integers, got {sizes!r}")
        for j, size in enumerate(sizes):
            _check_count(size, f"batch_sizes[{j}]", "each batch size")
        # The fits interpolate between neighbouring sizes: they must ascend.
        if any(a >= b for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"batch sizes must be distinct and ascending, got {list(sizes)}")
        _check_count(self.batch_size, "batch_size", "the batch size")
        _check_count(self.chunks, "chunks", "the micro-batch count")
        for what in ("device", "device_name", "torch_version", "dtype"):
            if not isinstance(getattr(self, what), str):
                raise ValueError(f"{what} must be a string, got {getattr(self, what)!r}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be an object, got {self.meta!r}")
        n = len(sizes)
        _check_figures(self.input, "input", n, _BYTES)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise ValueError(f"layers[{i}] must be a LayerProfile, got {layer!r}")
            _check_layer(layer, f"layers[{i}]", n)
        _check_tied(self.tied, len(self.layers))
        _check_sums(self.layers)

        self._fits: dict[tuple[int, str], tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def micro_batch(self, chunks: int | None = None) -> int:
        """The largest micro-batch size when the mini-batch is cut into ``chunks``."""
        m = self.chunks if chunks is None else chunks
        return math.ceil(self.batch_size / m)

    def fit(self, index: int, figure: str) -> tuple[float, float]:
        """The fitted ``(a, b)`` of one layer's figure: ``value = a + b * batch``.

        Args:
            index: the layer's position; ``-1`` with ``figure="input"`` is the model input.
            figure: ``forward``, ``backward``, ``saved``, ``shared``, ``output``, ``peak`` or
                ``input``.
        """
        key = (index, figure)
        if key not in self._fits:
            if figure == "input":
                values: list[float] | list[int] | None = self.input
            else:
                values = getattr(self.layers[index], figure)
            self._fits[key] = (0.0, 0.0) if values is None else fit_linear(self.batch_sizes, values)
        return self._fits[key]

    def values(self, index: int, figure: str) -> list[float] | None:
        """One layer's measured figure at :attr:`batch_sizes` (``-1``, ``input``: the input)."""
        if figure == "input":
            return [float(v) for v in self.input]
        found = getattr(self.layers[index], figure)
        return None if found is None else [float(v) for v in found]

    def segment(self, index: int, figure: str, batch: float) -> tuple[float, float]:
        """The ``(a, b)`` of the line through the measurements around ``batch``.

        Between two measured sizes a figure is interpolated linearly, so every measured
        size is predicted as measured (times of small micro-batches are far from a straight
        line: a kernel's launch, a weight read that does not grow with the rows); beyond the
        measured range the nearest segment goes on (see :func:`profiler.fit.segments`).
        """
        values = self.values(index, figure)
        if values is None:
            return 0.0, 0.0
        a, b = segments(self.batch_sizes, np.array([values]), batch)
        return float(a[0]), float(b[0])

    def predict(self, index: int, figure: str, batch: float) -> float:
        """A layer's figure at any micro-batch size (see :meth:`segment`)."""
        a, b = self.segment(index, figure, batch)
        return max(a + b * batch, 0.0)

    def fits(self, index: int) -> dict[str, tuple[float, float]]:
        """The fitted (a, b) of each figure of one layer."""
        return {key: self.fit(index, key) for key in ("forward", "backward", "saved", "output")}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.tied:  # profiles without tied state read as before it was recorded
            del data["tied"]
        for item in data.get("tied", []):  # and tied state free to split as before
            if not item["unsplit"]:
                del item["unsplit"]
        for layer in data["layers"]:  # uncounted layers read as before counts existed
            for what in _LAYER_COUNTS:
                if layer[what] is None:
                    del layer[what]
            if layer["shards"] is None:  # and layers counted without a TP plan too
                del layer["shards"]
            if layer["experts"] is None:  # and layers without routed experts
                del layer["experts"]
            # and layers counted before these were, or nothing re-built
            for what in ("gemm_saved", "norm_saved", "up_proj_saved", "rebuilt"):
                if layer[what] is None:
                    del layer[what]
        data["fits"] = [
            {key: list(value) for key, value in self.fits(i).items()} for i in range(len(self))
        ]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(
                f"profile format version {version!r} is not supported (expected "
                f"{PROFILE_VERSION}); re-create it with `autopipe profile`"
            )
        given = {k: v for k, v in data.items() if k != "fits"}  # fits are derived
        _check_fields(cls, given, "the profile")
        found = given.pop("layers")
        if not isinstance(found, list):
            raise ValueError(f"not a valid autopipe profile: layers must be a list, got {found!r}")
        layers = []
        for i, layer in enumerate(found):
            if not isinstance(layer, dict):
                raise ValueError(f"layers[{i}] must be an object, got {layer!r}")
            _check_fields(LayerProfile, layer, f"layers[{i}]")
            shards = layer.get("shards")
            if shards is not None:
                n = len(data.get("batch_sizes") or [])
                counts = ShardCounts.from_dict(shards, f"layers[{i}].shards", n)
                layer = {**layer, "shards": counts}
            experts = layer.get("experts")
            if experts is not None:
                n = len(data.get("batch_sizes") or [])
                found_experts = ExpertCounts.from_dict(experts, f"layers[{i}].experts", n)
                layer = {**layer, "experts": found_experts}
            layers.append(LayerProfile(**layer))
        tied = given.pop("tied", [])
        if not isinstance(tied, list) or not all(isinstance(t, dict) for t in tied):
            raise ValueError(
                f"not a valid autopipe profile: tied must be a list of objects, got {tied!r}"
            )
        for i, item in enumerate(tied):
            _check_fields(TiedState, item, f"tied[{i}]")
        return cls(layers=layers, tied=[TiedState(**t) for t in tied], **given)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the profile as JSON, atomically (no half-written file on failure)."""
        write_json(path, "profile", self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Reads a profile written by :meth:`save`.

        Raises:
            ValueError: the file is not a profile of a supported version, or a field is
                missing or invalid; the message names the file and the field.
        """
        data = read_json(path, "profile")
        try:
            return cls.from_dict(data)
        except ValueError as exc:  # name the file: the message names the field
            raise ValueError(f"{path}: {exc}") from None
