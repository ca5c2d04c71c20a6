"""Per-layer figures at a micro-batch size, interpolated from a profile's measurements."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from profiler import Profile, TiedState, segments

__all__: list[str] = []

# Optimizer state bytes per parameter byte. The ``-mixed`` names are mixed-precision
# training with 2-byte (bfloat16 or float16) parameters and gradients whose optimizer keeps
# float32 master weights (4 bytes per parameter) besides its float32 state: Adam's m and v
# make 12 bytes per parameter, 6 per parameter byte, so 16 bytes per parameter with the
# weight and gradient; SGD's master weights alone 2, with momentum 4.
OPTIMIZER_STATES = {
    "none": 0.0,
    "sgd": 0.0,
    "momentum": 1.0,
    "adam": 2.0,
    "adamw": 2.0,
    "sgd-mixed": 2.0,
    "momentum-mixed": 4.0,
    "adam-mixed": 6.0,
    "adamw-mixed": 6.0,
}
# The figures of a layer that scale with the micro-batch size.
_FIGURES = ("forward", "backward", "backward_input", "saved", "shared", "output", "peak")

Array = NDArray[np.float64]


_CALIBRATED = (
    "overhead_s",
    "virtual_overhead_s",
    "bandwidth",
    "latency_s",
    "compute_scale",
    "fixed_scale",
    "alone_compute_scale",
    "alone_fixed_scale",
    "allreduce_bandwidth",
    "update_s_per_byte",
    "step_overhead_s",
)


def calibrated_figures(profile: Profile) -> dict[str, float]:
    """The executor overhead, link figures and compute scale measured for the profile.

    ``autopipe calibrate`` stores them under ``profile.meta["calibration"]`` as
    ``overhead_s`` (seconds per stage and micro-batch; ``virtual_overhead_s`` that of the
    runner with virtual stages, when measured), ``bandwidth`` (bytes/s),
    ``latency_s`` (seconds per message between stages), ``allreduce_bandwidth`` (of the
    data-parallel gradient sync), and ``compute_scale`` and ``fixed_scale`` (how much
    longer the layers' per-sample and per-micro-batch times are in a whole training
    step than each layer's alone in the profile), and ``update_s_per_byte`` (seconds of
    the optimizer's step per parameter byte, timed in a pipeline's own steps) and
    ``step_overhead_s`` (the runner's fixed seconds per step, fitted on them).
    """
    found = calibrated_source(profile)
    out = {}
    for key in _CALIBRATED:
        value = found.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            out[key] = float(value)
    return out


def _compute_scale(profile: Profile, alone: bool = False) -> tuple[float, float]:
    """How much longer layers run inside a training step than alone (calibrated, else 1).

    Timed alone, a layer finds its weights and inputs in cache; in a step they were
    evicted by the layers before it. ``autopipe calibrate --model`` measures it on the
    whole model and stores ``meta["calibration"]["fixed_scale"]`` (the factor of each
    layer's per-micro-batch time, the fit's ``a``) and ``compute_scale`` (of its per-sample
    time, ``b``); with only ``compute_scale`` both parts get it. Measured across ranks
    (:func:`autopipe.distributed.calibration.calibrate_ranks`), these are the scales with every
    rank busy, and ``alone_fixed_scale`` / ``alone_compute_scale`` those of one rank
    computing alone, which a configuration on a single device gets (``alone=True``).

    Returns:
        ``(fixed_scale, compute_scale)``.
    """
    # Beyond a thousandfold a scale is a measurement gone wrong, not a slow cache.
    measured = calibrated_figures(profile)
    found = {k: v for k, v in measured.items() if k.endswith("scale") and v < 1e3}
    prefix = "alone_" if alone and "alone_compute_scale" in found else ""
    per_sample = found.get(f"{prefix}compute_scale", 1.0)
    fixed = found.get(f"{prefix}fixed_scale", per_sample)
    return fixed, per_sample


def layer_scales(profile: Profile) -> dict[str, Array]:
    """The per-layer factors of ``meta["calibration"]["layer_scales"]`` (forward and
    backward, one finite positive number per layer each), or none when absent.

    Raises:
        ValueError: present but not one factor per layer.
    """
    found = calibrated_source(profile).get("layer_scales")
    if found is None:
        return {}
    out = {}
    for figure in ("forward", "backward"):
        values = found.get(figure) if isinstance(found, dict) else None
        array = np.asarray(values if values is not None else [], dtype=float)
        if array.shape != (len(profile),) or not (np.isfinite(array).all() and (array > 0).all()):
            raise ValueError(
                f"the profile's calibration.layer_scales.{figure} must hold one positive "
                f"factor per layer ({len(profile)}); measure again or remove it"
            )
        out[figure] = array
    return out


def calibrated_source(profile: Profile) -> dict[str, Any]:
    """``profile.meta["calibration"]``, or an empty dict."""
    found = profile.meta.get("calibration") if isinstance(profile.meta, dict) else None
    return found if isinstance(found, dict) else {}


def optimizer_factor(optimizer: str | float) -> float:
    """Optimizer state bytes per parameter byte, from a name or a number.

    The names (case-insensitive): ``none`` and ``sgd`` 0, ``momentum`` 1, ``adam`` and
    ``adamw`` 2 (state in the parameters' dtype), and for mixed precision with 2-byte
    parameters and float32 master weights ``sgd-mixed`` 2, ``momentum-mixed`` 4,
    ``adam-mixed`` and ``adamw-mixed`` 6 (4 master + 4 m + 4 v bytes per 2-byte parameter;
    16 bytes per parameter with the weight and gradient). The ``-mixed`` factors assume the
    profile's parameter bytes are those of the 2-byte parameters (profile with
    ``--dtype bfloat16``); a float32 profile under autocast trains float32 weights, which
    ``adam`` describes.
    """
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if not (math.isfinite(optimizer) and optimizer >= 0):
            raise ValueError(
                f"optimizer state factor must be a finite number >= 0 (state bytes per "
                f"parameter byte, e.g. 2 for Adam), got {optimizer}"
            )
        return float(optimizer)
    if not isinstance(optimizer, str):
        raise TypeError(
            f"optimizer must be a name such as 'adam' or state bytes per parameter byte, "
            f"got {optimizer!r}"
        )
    try:
        return OPTIMIZER_STATES[optimizer.lower()]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)} "
            "or give the state bytes per parameter byte as a number"
        ) from None


class StageExposure(Protocol):
    """What a stage's passes wait for beyond its layers' own figures, by where it starts
    and ends (ZeRO-2/3's exchanges,
    :class:`autopipe.planning.mesh.zero_exchange.StageExchanges`)."""

    def exposed(self, s: Any, e: Any) -> tuple[Array, Array]:
        """Seconds added to the forward and to the backward of one micro-batch of a stage
        of layers ``[s, e)``, at least 0."""
        ...


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer figures at one micro-batch size (seconds and bytes).

    ``shared[i]`` is the part of ``saved[i]`` that layer ``i − 1`` saves too (one storage,
    held once when both layers are in one stage); ``shared[0]`` is 0.
    """

    names: list[str]
    forward: Array
    backward: Array
    saved: Array
    output: Array
    params: Array
    buffers: Array
    peak: Array
    input: float
    shared: Array | None = None
    # Of ``backward``, the input's gradient alone (measured), or None: unknown.
    backward_input: Array | None = None
    # Tensors several layers use, counted in each user's params (or buffers).
    tied: tuple[TiedState, ...] = ()
    # Seconds of the optimizer's step per parameter byte (calibrated, else 0: free).
    update_per_byte: float = 0.0
    # The runner's fixed seconds per step (calibrated, else 0).
    step_overhead: float = 0.0
    # Per stage, the passes' exposed exchanges (None: nothing beyond the layers' figures).
    exposure: StageExposure | None = None
    # Of ``params``, the routed experts' bytes on the device, whose state shards over the
    # expert-data-parallel group (None: no routed experts; see autopipe.planning.mesh).
    experts: Array | None = None
    # Of ``forward`` and ``backward`` (and ``backward_input``), the routed experts'
    # all-to-alls, which DualPipeV's overlapped pairs hide in part (None: none).
    alltoall_forward: Array | None = None
    alltoall_backward: Array | None = None
    # Bytes each layer's backward re-builds before it runs, no part of ``saved`` (its
    # re-computed norms' outputs; None: none), held from the input gradient's pass until
    # the weights' under split backward.
    rebuilt: Array | None = None

    def __post_init__(self) -> None:
        if self.shared is None:  # frozen: set once, at construction
            object.__setattr__(self, "shared", np.zeros(len(self.names)))

    def first_use(self) -> tuple[Array, Array]:
        """``(params, buffers)`` with each tied tensor counted at its first user only.

        Additive, and never above what a stage holds (a stage without the first user of
        a tied tensor holds a copy these leave out), so bounds built on prefix sums of
        them stay lower bounds.
        """
        params, buffers = self.params.copy(), self.buffers.copy()
        for item in self.tied:
            later = list(item.layers[1:])
            target = buffers if item.buffer else params
            target[later] = np.maximum(target[later] - item.bytes, 0.0)
        return params, buffers

    @property
    def shared_bytes(self) -> Array:
        """``shared`` as an array (zeros when not measured)."""
        assert self.shared is not None
        return self.shared

    @classmethod
    def from_profile(cls, profile: Profile, micro_batch: int) -> LayerCosts:
        """Predicts every figure at ``micro_batch`` samples from the profile's fits."""
        return ProfileLines.from_profile(profile).at(micro_batch)

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class ProfileLines:
    """Every layer's measured figures as arrays, for fast predictions at many sizes.

    A figure at any size is interpolated linearly between the two measured sizes around it
    (:meth:`profiler.profile.Profile.segment`: the nearest segment beyond the measured
    range, never falling with the batch there). Times are calibrated per segment line
    ``a + b·size``: ``fixed_scale·a + compute_scale·b·size`` (see :func:`_compute_scale`).

    Attributes:
        names: the layers' names.
        sizes: the measured micro-batch sizes.
        values: per figure, every layer's measurements (layers × sizes).
        input: the model input's bytes at each measured size.
        params: parameter bytes per layer.
        buffers: buffer bytes per layer.
        scale: ``(fixed_scale, compute_scale)`` applied to times.
        layer_scale: per figure (``forward``, ``backward``), a factor per layer fitted on
            steps timed where they ran (:mod:`autopipe.planning.model.in_place_fit`), or
            empty: none.
        split_backward: whether every layer's backward to its input alone was measured.
        tied: the tensors several layers use (see :class:`profiler.profile.TiedState`).
        experts: of ``params``, the routed experts' bytes per layer on one device of an
            expert-parallel mesh, or ``None`` (:mod:`autopipe.planning.mesh.expert_figures`).
    """

    names: list[str]
    sizes: Array
    values: dict[str, Array]
    input: Array
    params: Array
    buffers: Array
    scale: tuple[float, float] = (1.0, 1.0)
    layer_scale: dict[str, Array] = field(default_factory=dict)
    split_backward: bool = False
    tied: tuple[TiedState, ...] = ()
    update_per_byte: float = 0.0
    step_overhead: float = 0.0
    experts: Array | None = None

    @classmethod
    def from_profile(cls, profile: Profile, alone: bool = False) -> ProfileLines:
        """Collects the profile's measurements.

        Args:
            profile: the profile.
            alone: for a configuration on one device (see :func:`_compute_scale`).
        """
        n, width = len(profile), len(profile.batch_sizes)
        measured = calibrated_figures(profile)
        values = {}
        for figure in _FIGURES:
            rows = [profile.values(i, figure) for i in range(n)]
            values[figure] = np.array([r if r is not None else [0.0] * width for r in rows])
        rebuilt = [profile.values(i, "rebuilt") for i in range(n)]
        if any(r is not None for r in rebuilt):
            values["rebuilt"] = np.array([r if r is not None else [0.0] * width for r in rebuilt])
        # Under the FP8 recipe the weight GEMMs' inputs are saved in one byte each.
        factor = saved_factor(profile)
        if factor is not None:
            values["saved"] = values["saved"] * factor
            values["shared"] = shared_fp8(profile, values["shared"])
        return cls(
            names=profile.names,
            sizes=np.array(profile.batch_sizes, dtype=float),
            values=values,
            input=np.array(profile.input, dtype=float),
            params=np.array([float(layer.param_bytes) for layer in profile.layers]),
            buffers=np.array([float(layer.buffer_bytes) for layer in profile.layers]),
            scale=_compute_scale(profile, alone),
            layer_scale=layer_scales(profile),
            split_backward=all(layer.backward_input is not None for layer in profile.layers),
            tied=tuple(profile.tied),
            update_per_byte=measured.get("update_s_per_byte", 0.0),
            step_overhead=measured.get("step_overhead_s", 0.0),
        )

    def figure(self, name: str, micro_batch: float) -> Array:
        """One figure of every layer at ``micro_batch`` samples (times calibrated)."""
        a, b = segments(self.sizes, self.values[name], micro_batch)
        if name in ("forward", "backward", "backward_input"):
            a, b = a * self.scale[0], b * self.scale[1]
            factor = self.layer_scale.get("forward" if name == "forward" else "backward")
            if factor is not None:
                a, b = a * factor, b * factor
        return np.maximum(a + b * micro_batch, 0.0)

    def at(self, micro_batch: float, time_batch: float | None = None) -> LayerCosts:
        """Every figure at ``micro_batch`` samples (times at ``time_batch`` if given).

        A batch that M does not divide splits into micro-batches of ``ceil(N/M)`` and one
        fewer samples: memory is safe at the largest, while times summed over the M
        micro-batches are exact at the mean ``N/M`` (every time is linear in the size).
        """
        when = micro_batch if time_batch is None else time_batch
        a, b = segments(self.sizes, self.input, micro_batch)
        return LayerCosts(
            names=self.names,
            forward=self.figure("forward", when),
            backward=self.figure("backward", when),
            saved=self.figure("saved", micro_batch),
            output=self.figure("output", micro_batch),
            params=self.params,
            buffers=self.buffers,
            peak=self.figure("peak", micro_batch),
            input=float(a + b * micro_batch),
            # Never more than the layer saves, whatever the two fits do between sizes.
            shared=np.minimum(
                self.figure("shared", micro_batch), self.figure("saved", micro_batch)
            ),
            backward_input=np.minimum(
                self.figure("backward_input", when), self.figure("backward", when)
            )
            if self.split_backward
            else None,
            tied=self.tied,
            update_per_byte=self.update_per_byte,
            step_overhead=self.step_overhead,
            experts=self.experts,
            rebuilt=self.figure("rebuilt", micro_batch) if "rebuilt" in self.values else None,
        )


# Saved bytes under an FP8 recipe: the weight GEMMs' activation inputs in one byte each.
#
# Megatron's FP8 recipe (Transformer Engine) and DeepSeek-V3 save the input of every linear
# layer's GEMM quantized to FP8 for its weight gradient. A profile whose estimate prices
# ``float8`` (``meta["estimate"]["dtype"]``) therefore holds, of each layer's saved bytes,
# its ``gemm_saved`` (:attr:`profiler.LayerProfile.gemm_saved`) at one byte per element
# instead of the compute dtype's ``s`` bytes::
#
#     saved' = saved − gemm_saved · (1 − 1/s)
#
# Everything else a layer saves stays in its dtype: attention's queries, keys, values and
# output, norms' and activations' inputs; weights and their gradients too. The reduction
# is a factor ``saved'/saved`` per layer and batch size, which the saved bytes' tensor- and
# context-parallel parts (:mod:`autopipe.planning.mesh.degree_figures`) and the routed
# experts' share take alike. The bytes a layer shares with the one before it lose the
# layer's whole ``gemm_saved``: a shared storage that a GEMM takes is held in full by the
# layer before and in FP8 by this one (never more shared than that, so memory is never
# under-counted). Profiles without the figure (older ones) plan as before.

_FP8 = "float8"
# Bytes per element of the dtypes a profile's matmuls run in.
_ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def fp8_estimate(profile: Profile) -> bool:
    """Whether the profile's times were estimated for the FP8 recipe."""
    found = profile.meta.get("estimate") if isinstance(profile.meta, dict) else None
    return isinstance(found, dict) and found.get("dtype") == _FP8


def element_bytes(profile: Profile) -> int | None:
    """Bytes per element of the dtype the profile's matmuls ran in (its ``autocast``
    dtype, else its ``dtype``), ``None`` when unknown."""
    return _ELEMENT_BYTES.get(profile.autocast or profile.dtype)


def gemm_savings(profile: Profile) -> Array | None:
    """The bytes FP8 saves of each layer's saved bytes (layers × batch sizes), ``None``
    when the profile is no float8 estimate or no layer counted its GEMM inputs."""
    size = element_bytes(profile)
    if not fp8_estimate(profile) or size is None or size <= 1:
        return None
    layers = profile.layers
    if all(layer.gemm_saved is None for layer in layers):
        return None
    zeros = [0.0] * len(profile.batch_sizes)
    gemm = np.array([layer.gemm_saved or zeros for layer in layers], dtype=float)
    return gemm * (1.0 - 1.0 / size)


def saved_factor(profile: Profile) -> Array | None:
    """``saved'/saved`` per layer and batch size (1 where nothing is saved), ``None``
    when nothing changes (see :func:`gemm_savings`)."""
    savings = gemm_savings(profile)
    if savings is None:
        return None
    saved = np.array([layer.saved for layer in profile.layers], dtype=float)
    kept = np.maximum(saved - savings, 0.0)
    return np.where(saved > 0, kept / np.where(saved > 0, saved, 1.0), 1.0)


def shared_fp8(profile: Profile, shared: Array) -> Array:
    """The bytes each layer shares with the one before it, less its GEMM inputs (which it
    holds in FP8 beside the earlier layer's copy); ``shared`` unchanged when the profile
    plans as before."""
    if gemm_savings(profile) is None:
        return shared
    zeros = [0.0] * len(profile.batch_sizes)
    gemm = np.array([layer.gemm_saved or zeros for layer in profile.layers], dtype=float)
    return np.asarray(np.maximum(shared - gemm, 0.0))
