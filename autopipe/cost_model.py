"""The cost and memory model of a pipeline stage, vectorized over candidate stage bounds.

A stage holding layers ``[s, e)`` on device ``k`` costs, per micro-batch::

    c_k(s, e) = (F(s,e) · (1 + r) + B(s,e)) / speed_k + out(e) / bandwidth_k

where F and B sum the layers' forward and backward times, ``r`` is the fraction of
micro-batches that are re-computed (checkpointed), and ``out(e)`` is the size of the
boundary sent to the next stage (zero after the last). Its peak memory is::

    m_k(s, e) = P(s,e) · (2 + opt) + Buf(s,e) + ck_k · in(s) + keep_k · S(s,e) + peak(s,e)

with parameters P (plus gradients and ``opt`` optimizer states per parameter byte), buffers
Buf, the stage's boundary input ``in(s)``, the saved-for-backward bytes S of one
micro-batch and the largest transient peak of a layer. Of the ``n_k`` micro-batches in
flight on stage k (GPipe: M; 1F1B: min(M, K−k)), ``ck_k`` are checkpointed and keep only
their input; the others keep all saved tensors, and a re-computation holds one
micro-batch's saved tensors at a time (``keep_k = n_k − ck_k``, at least 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from autopipe.devices import DeviceSpec
from profiler.profile import Profile

__all__ = [
    "CHECKPOINT_MODES",
    "OPTIMIZER_STATES",
    "SCHEDULES",
    "CostModel",
    "LayerCosts",
    "optimizer_factor",
]

CHECKPOINT_MODES = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b")
# Optimizer state bytes per parameter byte.
OPTIMIZER_STATES = {"none": 0.0, "sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0}

Array = NDArray[np.float64]


def optimizer_factor(optimizer: str | float) -> float:
    """Optimizer state bytes per parameter byte, from a name or a number."""
    if isinstance(optimizer, (int, float)):
        if optimizer < 0:
            raise ValueError(f"optimizer state factor must be >= 0, got {optimizer}")
        return float(optimizer)
    try:
        return OPTIMIZER_STATES[optimizer.lower()]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)} "
            "or give the state bytes per parameter byte as a number"
        ) from None


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer figures at one micro-batch size (seconds and bytes)."""

    names: list[str]
    forward: Array
    backward: Array
    saved: Array
    output: Array
    params: Array
    buffers: Array
    peak: Array
    input: float

    @classmethod
    def from_profile(cls, profile: Profile, micro_batch: int) -> LayerCosts:
        """Predicts every figure at ``micro_batch`` samples from the profile's fits."""
        n = len(profile)

        def figure(name: str) -> Array:
            return np.array([profile.predict(i, name, micro_batch) for i in range(n)])

        return cls(
            names=profile.names,
            forward=figure("forward"),
            backward=figure("backward"),
            saved=figure("saved"),
            output=figure("output"),
            params=np.array([float(layer.param_bytes) for layer in profile.layers]),
            buffers=np.array([float(layer.buffer_bytes) for layer in profile.layers]),
            peak=figure("peak"),
            input=profile.predict(-1, "input", micro_batch),
        )

    def __len__(self) -> int:
        return len(self.names)


def _prefix(values: Array) -> Array:
    return np.concatenate([[0.0], np.cumsum(values)])


class _RangeMax:
    """Sparse table for vectorized range-maximum queries over ``[s, e)``."""

    def __init__(self, values: Array) -> None:
        self.table = [values]
        width = 1
        while 2 * width <= len(values):
            prev = self.table[-1]
            self.table.append(np.maximum(prev[:-width], prev[width:]))
            width *= 2

    def query(self, s: NDArray[np.int64], e: NDArray[np.int64]) -> Array:
        length = np.maximum(e - s, 1)
        level = np.floor(np.log2(length)).astype(np.int64)
        out = np.zeros(np.broadcast(s, e).shape)
        for lv in np.unique(level):
            row = self.table[int(lv)]
            mask = level == lv
            ss = np.broadcast_to(s, out.shape)[mask]
            ee = np.broadcast_to(e, out.shape)[mask]
            hi = np.clip(ee - (1 << int(lv)), 0, len(row) - 1)
            out[mask] = np.maximum(row[np.clip(ss, 0, len(row) - 1)], row[hi])
        return out


class CostModel:
    """Predicted time and memory of any candidate stage under a schedule.

    Args:
        layers: per-layer figures at the micro-batch size.
        devices: one entry per stage.
        chunks: micro-batches per mini-batch (M).
        checkpoint: ``always``, ``except_last`` or ``never``.
        schedule: ``gpipe`` or ``1f1b``.
        optimizer: optimizer state bytes per parameter byte (see :func:`optimizer_factor`).
    """

    def __init__(
        self,
        layers: LayerCosts,
        devices: Sequence[DeviceSpec],
        chunks: int,
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
        optimizer: float = 2.0,
    ) -> None:
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(
                f"unknown checkpoint mode {checkpoint!r}: choose {', '.join(CHECKPOINT_MODES)}"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: choose {', '.join(SCHEDULES)}")
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.layers = layers
        self.devices = list(devices)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.optimizer = optimizer
        self._fwd = _prefix(layers.forward)
        self._bwd = _prefix(layers.backward)
        self._saved = _prefix(layers.saved)
        self._state = _prefix(layers.params * (2.0 + optimizer) + layers.buffers)
        # Boundary input of a stage starting at s: the model input or layer s−1's output.
        self._inputs = np.concatenate([[layers.input], layers.output])
        self._sends = np.concatenate([[0.0], layers.output[:-1], [0.0]])
        self._peak = _RangeMax(layers.peak) if np.any(layers.peak > 0) else None

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def recompute_fraction(self) -> float:
        """Share of micro-batches whose forward runs again in backward."""
        m = self.chunks
        return {"always": 1.0, "except_last": (m - 1) / m, "never": 0.0}[self.checkpoint]

    def in_flight(self, k: int) -> int:
        """Micro-batches whose activations stage ``k`` holds at its peak."""
        if self.schedule == "1f1b":
            return min(self.chunks, self.num_stages - k)
        return self.chunks

    def checkpointed(self, k: int) -> tuple[int, int]:
        """``(ck, keep)``: in-flight micro-batches stored as inputs only, and as saved sets."""
        n = self.in_flight(k)
        ck = {"always": n, "except_last": min(n, self.chunks - 1), "never": 0}[self.checkpoint]
        return ck, max(n - ck, 1)

    def layer_time(self) -> Array:
        """Per-layer cost per micro-batch on a speed-1 device, transfers excluded."""
        return self.layers.forward * (1.0 + self.recompute_fraction) + self.layers.backward

    def compute_time(self, k: int, s: NDArray[np.int64], e: NDArray[np.int64]) -> Array:
        fwd = self._fwd[e] - self._fwd[s]
        bwd = self._bwd[e] - self._bwd[s]
        return (fwd * (1.0 + self.recompute_fraction) + bwd) / self.devices[k].speed

    def transfer_time(self, k: int, e: NDArray[np.int64]) -> Array:
        bandwidth = self.devices[k].bandwidth
        if bandwidth is None:
            return np.zeros(np.shape(e))
        # A stage ending at e sends layer e−1's output, unless it is the last stage.
        return self._sends[e] / bandwidth

    def stage_time(self, k: int, s: NDArray[np.int64], e: NDArray[np.int64]) -> Array:
        """Cost per micro-batch of stage ``k`` holding layers ``[s, e)``."""
        return self.compute_time(k, s, e) + self.transfer_time(k, e)

    def state_memory(self, s: NDArray[np.int64], e: NDArray[np.int64]) -> Array:
        """Parameters, gradients, optimizer state and buffers of layers ``[s, e)``."""
        return self._state[e] - self._state[s]

    def activation_memory(self, k: int, s: NDArray[np.int64], e: NDArray[np.int64]) -> Array:
        """Activations stage ``k`` holds at its peak with layers ``[s, e)``."""
        ck, keep = self.checkpointed(k)
        out = ck * self._inputs[s] + keep * (self._saved[e] - self._saved[s])
        if self._peak is not None:
            out = out + self._peak.query(s, e)
        return out

    def stage_memory(self, k: int, s: NDArray[np.int64], e: NDArray[np.int64]) -> Array:
        """Peak bytes of stage ``k`` holding layers ``[s, e)``."""
        return self.state_memory(s, e) + self.activation_memory(k, s, e)

    def capacity(self, k: int) -> float:
        memory = self.devices[k].memory
        return math.inf if memory is None else float(memory)

    def signature(self, k: int) -> tuple[object, ...]:
        """Stages with equal signatures have identical cost and memory functions."""
        device = self.devices[k]
        return (device.speed, device.bandwidth, self.checkpointed(k), self.capacity(k))

    def sum_is_invariant(self) -> bool:
        """Whether ``Σ_k c_k`` is the same for every split (equal speeds, free transfers)."""
        speeds = {d.speed for d in self.devices}
        return len(speeds) == 1 and all(d.bandwidth is None for d in self.devices)
