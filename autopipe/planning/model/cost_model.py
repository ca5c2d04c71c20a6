"""The cost and memory model of a pipeline stage, vectorized over candidate stage bounds.

A stage holding layers ``[s, e)`` on device ``k`` costs, per micro-batch::

    c_k(s, e) = (F(s,e) · (1 + r) + B(s,e)) / speed_k + o + λ_k + out(e) / bandwidth_k

where F and B sum the layers' forward and backward times, ``r`` is the fraction of
micro-batches that are re-computed (checkpointed), ``o`` is the executor's fixed overhead
per stage and micro-batch (calibrated, else 0), ``out(e)`` is the size of the boundary
sent to the next stage and ``λ_k`` the link's fixed latency per message (both zero after
the last stage). Its peak memory is::

    m_k(s, e) = P(s,e) · (2 + opt) + Buf(s,e) + ck_k · in(s) + keep_k · S(s,e) + peak(s,e)

with parameters P (plus gradients and ``opt`` optimizer state bytes per parameter byte,
see :func:`optimizer_factor`; ``adam-mixed``: 6, float32 master weights and Adam state for
2-byte parameters), buffers Buf, the stage's boundary input ``in(s)``, the
saved-for-backward bytes S of one micro-batch and the largest transient peak of a layer.
Of the ``n_k`` micro-batches in flight on stage k (GPipe: M; 1F1B: min(M, K−k); with
virtual stages see :mod:`autopipe.planning.schedules.interleaving`), ``ck_k`` are checkpointed and
keep only their input; the others keep all saved tensors, and a re-computation holds one
micro-batch's saved tensors at a time (``keep_k = n_k − ck_k``, at least 1). Under split
backward (zb, zbv, dualpipev) the counts come from the replayed order instead
(:mod:`autopipe.planning.schedules.split_holding`), and bytes the backward re-builds
beyond the saved set (``layers.rebuilt``: re-computed modules' outputs) are held by the
micro-batches between their input gradient and their weights'.

Checkpoint mode ``auto`` decides per stage: a stage runs ``never`` if its memory fits, else
``except_last``, so it checkpoints only when it must. (``always`` never does better than
``except_last``: it re-computes more and keeps at least as many boundary inputs.) Since the
step time grows with every c_k and each stage's choice only affects its own memory,
choosing per candidate stage inside the split search stays exact.

With D data-parallel replicas of the pipeline, each stage all-reduces its gradients among
its D copies once per step (ring all-reduce, after the pipeline drains, no overlap)::

    a_k(s, e) = 2 · (D − 1) / D · P(s,e) / allreduce_bandwidth

With a context-parallel group of ``c`` (``CostOptions.mesh``) the parameters are
replicated over it too, and every ring and share below runs over ``S = D·c`` devices.

The stages' rings use disjoint devices and run at once, so a step costs ``max_k a_k``.

With ``shard_optimizer`` (ZeRO stage 1, as DeepSpeed's ``zero_optimization.stage = 1`` and
Megatron-LM's ``--use-distributed-optimizer``) each of a stage's D copies keeps the
optimizer state of only a 1/D share of its parameters: ``P · (2 + opt / D)`` in place of
``P · (2 + opt)``, weights and gradients still whole. The gradient all-reduce then becomes a
reduce-scatter (each copy gets the summed gradients of its share and updates it) plus an
all-gather of the updated parameters: ``(D − 1)/D · P`` each (parameters and gradients of
one dtype), the ring all-reduce's ``2 · (D − 1)/D · P`` in all, so the step time model does
not change (the optimizer step, which it does not time, only gets shorter). With D = 1 it
changes nothing.

With routed experts (``layers.experts``, expert parallelism of degree ``e``) their bytes
hold ``P_x · f(S_x)`` instead, the state factor ``f`` of the ZeRO stage over the
``S_x = t·D·c / e`` devices holding the same experts; their exchange after the drain is
priced at the dense part's rate per byte (:mod:`autopipe.planning.mesh.expert_figures`).

ZeRO-2 (``mesh.zero = 2``) shards the gradients too: ``P · (1 + (1 + opt) / S)``, each
unit's gradients reduce-scattered as its backward ends, every micro-batch (the layers'
times carry what of it is exposed, :mod:`autopipe.planning.mesh.zero_exchange`), and once
per step only the all-gather of the updated parameters, ``(S − 1)/S · P``. ZeRO-3 shards
the parameters as well: ``P · (2 + opt) / S``, each unit gathered whole while it runs (the
layers' transient peaks carry it) and nothing left to exchange after the drain.

A tensor several layers use (tied, :class:`profiler.profile.TiedState`) is counted in each
user's ``P`` (or ``Buf``); a stage holds one copy of it however many of its layers use
it, so ``P(s,e)`` counts it once per stage that holds a user. The ``n ≥ 2`` stages holding
copies of a tied parameter (``n`` ranks: a rank's virtual stages share one) sum their
gradients once per step (a ring all-reduce over the links between them, after the
pipeline drains)::

    t = 2 · (n − 1) / n · bytes / bandwidth + 2 · (n − 1) · λ

with the slowest bandwidth and the largest latency of the holders' links (else the
all-reduce bandwidth; free when neither is known), added to the step time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.colocation import shared_groups
from autopipe.planning.model.cut_rules import forbidden_cuts
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import (
    LayerCosts,
    optimizer_factor,
)
from autopipe.planning.model.mesh import Mesh
from autopipe.planning.model.names import (
    ALL_SCHEDULES,
    CHECKPOINT_MODES,
    FIXED_CHECKPOINT_MODES,
    V_SCHEDULES,
)
from autopipe.planning.model.spans import RangeMax, prefix_sums
from autopipe.planning.model.unit_recompute import Holding, UnitRecompute
from autopipe.planning.schedules.interleaving import (
    held_shares,
    in_flight,
    rank_stages,
    stage_placement,
)
from autopipe.planning.schedules.schedule_replay import RECOMPUTE_CODES
from autopipe.planning.schedules.split_holding import (
    SPLIT_SCHEDULES,
    split_moments,
    stage_holdings,
    stage_keeps,
)

__all__ = ["optimizer_factor"]

# Share of a layer's backward that computes its weights' gradients (zero bubble defers
# it), for profiles that did not time the input's gradient alone: for a linear layer the
# input's and the weights' gradients are one matrix product each, so half; a layer
# without parameters has none.
_WEIGHT_SHARE = 0.5

Array = NDArray[np.float64]
Index = NDArray[np.int64]

# The mode index of a stage re-computing a set of its units, past the fixed modes', and
# the stage's checkpoint mode then.
UNITS = 2
UNITS_MODE = "units"


def state_factor(optimizer: float, zero: int, shard_over: int) -> float:
    """Bytes a device holds per parameter byte of its stage: weight, gradient and
    optimizer state, ZeRO stage ``zero`` sharding them over ``shard_over`` devices."""
    s = max(shard_over, 1)
    if zero >= 3:
        return (2.0 + optimizer) / s
    if zero == 2:
        return 1.0 + (1.0 + optimizer) / s
    if zero == 1:
        return 2.0 + optimizer / s
    return 2.0 + optimizer


def sync_factor(zero: int, shard_over: int, bandwidth: float | None) -> float:
    """Seconds per parameter byte of a stage's exchange after the pipeline drains: the
    ring all-reduce (ZeRO-0 and 1: ``2·(S−1)/S``), the parameters' all-gather (ZeRO-2:
    ``(S−1)/S``) or nothing (ZeRO-3), over ``bandwidth`` bytes/s (``None``: free)."""
    if shard_over < 2 or bandwidth is None or zero >= 3:
        return 0.0
    rings = 1.0 if zero == 2 else 2.0
    return rings * (shard_over - 1) / shard_over / bandwidth


def _finite_non_negative(value: object) -> bool:
    number = float(value) if isinstance(value, numbers.Real) else math.nan
    return not isinstance(value, bool) and math.isfinite(number) and number >= 0


class StageParts(NamedTuple):
    """A stage's times per micro-batch by part, its re-computation code and its memory.

    ``weight`` is the share of ``backward`` that computes the weights' gradients (what
    split backward defers; a re-computation runs with the input's part). ``held`` is what
    one micro-batch keeps, per :mod:`~autopipe.planning.schedules.split_holding`'s counts
    (last axis): its reduced set until its input-gradient pass, its full set from then
    until its weights', and the reduced set again while that pass re-builds the full set
    (0 where nothing is re-computed). ``comm_forward`` and ``comm_backward`` are, of
    ``forward`` and ``backward``, the routed experts' all-to-alls that ``dualpipev``'s
    overlapped pairs hide in part (0 under other schedules, which charge them whole).
    """

    forward: Array
    backward: Array
    transfer: Array
    recompute: Array
    memory: Array
    weight: Array
    held: Array
    comm_forward: Array | float = 0.0
    comm_backward: Array | float = 0.0


@dataclass(frozen=True)
class CostOptions:
    """What a :class:`CostModel` weighs besides the layers, the devices and the schedule.

    Attributes:
        overhead: the executor's fixed seconds per stage and micro-batch.
        data_parallel: replicas of the pipeline (D) whose gradients are all-reduced.
        allreduce_bandwidth: bytes/s of the all-reduce; ``None`` treats it as free.
        virtual_stages: stages per rank (v, see :mod:`autopipe.planning.schedules.interleaving`);
            the devices are then K·v stages, stage s on rank ``s % K``.
        shard_optimizer: each stage's D replicas shard its optimizer state (ZeRO-1, see
            the module docstring): a stage holds ``opt / D`` state bytes per parameter byte.
        colocated: the stages run in one process, so stages whose devices have the same
            name share that device and take turns on it
            (:mod:`autopipe.planning.model.colocation`).
        forbidden: positions ``1..L−1`` where no cut may go, besides those of the layers'
            ``unsplit`` tied tensors (:mod:`autopipe.planning.model.cut_rules`).
        mesh: the tensor, context and sharded data parallelism around the pipeline; the
            layers must be one device's of it (:mod:`autopipe.planning.mesh`). Its
            ``zero`` stage (``shard_optimizer`` is ZeRO-1) shards over ``D·c`` devices.
    """

    overhead: float = 0.0
    data_parallel: int = 1
    allreduce_bandwidth: float | None = None
    virtual_stages: int = 1
    shard_optimizer: bool = False
    colocated: bool = False
    forbidden: Sequence[int] = ()
    mesh: Mesh = field(default_factory=Mesh)

    @property
    def zero(self) -> int:
        """The ZeRO stage: the mesh's, at least 1 with ``shard_optimizer``."""
        return max(self.mesh.zero, 1 if self.shard_optimizer else 0)

    @property
    def shard_over(self) -> int:
        """Devices a stage's state is sharded (and its gradients summed) over: ``D·c``."""
        return self.data_parallel * self.mesh.context


class CostModel:
    """Predicted time and memory of any candidate stage under a schedule.

    Args:
        layers: per-layer figures at the micro-batch size.
        devices: one entry per stage.
        chunks: micro-batches per mini-batch (M).
        checkpoint: ``always``, ``except_last``, ``never`` or ``auto`` (per stage).
        schedule: ``gpipe`` or ``1f1b``.
        optimizer: optimizer state bytes per parameter byte (see :func:`optimizer_factor`).
        options: the overhead, replicas, virtual stages, sharding, colocation and
            forbidden cuts (:class:`CostOptions`; default: none of them).
    """

    def __init__(
        self,
        layers: LayerCosts,
        devices: Sequence[DeviceSpec],
        chunks: int,
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
        optimizer: float = 2.0,
        options: CostOptions | None = None,
    ) -> None:
        if options is None:
            options = CostOptions()
        elif not isinstance(options, CostOptions):
            raise TypeError(f"options must be a CostOptions, got {type(options).__name__}")
        overhead, data_parallel = options.overhead, options.data_parallel
        allreduce_bandwidth, virtual_stages = options.allreduce_bandwidth, options.virtual_stages
        shard_optimizer, colocated = options.shard_optimizer, options.colocated
        forbidden = options.forbidden
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(
                f"unknown checkpoint mode {checkpoint!r}: choose {', '.join(CHECKPOINT_MODES)}"
            )
        if schedule not in ALL_SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: choose {', '.join(ALL_SCHEDULES)}")
        if schedule in SPLIT_SCHEDULES and checkpoint == "except_last":
            raise ValueError(
                f"{schedule} splits the backward, so except_last (which spares the "
                "micro-batch whose whole backward comes first) has no clear meaning: plan it "
                "with checkpoint never, always or auto"
            )
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if not _finite_non_negative(overhead):
            raise ValueError(f"overhead must be finite seconds >= 0, got {overhead!r}")
        if not _finite_non_negative(optimizer):
            raise ValueError(
                f"optimizer state factor must be a finite number >= 0, got {optimizer!r}; "
                "convert a name with optimizer_factor()"
            )
        if data_parallel < 1:
            raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
        if not isinstance(shard_optimizer, bool):  # "no" would read as True
            raise TypeError(f"shard_optimizer must be True or False, got {shard_optimizer!r}")
        if schedule in V_SCHEDULES:  # 2 stages per rank, whether given or left at 1
            if virtual_stages not in (1, 2):
                raise ValueError(
                    f"{schedule} runs 2 stages per rank in a V, not {virtual_stages}: leave "
                    "virtual_stages unset or give 2"
                )
            virtual_stages = 2
        if virtual_stages < 1 or len(devices) % virtual_stages:
            raise ValueError(
                f"{len(devices)} stages do not split into {virtual_stages} virtual stages per "
                "rank: plan K·v stages"
            )
        if allreduce_bandwidth is not None and not allreduce_bandwidth > 0:
            raise ValueError(f"allreduce_bandwidth must be > 0, got {allreduce_bandwidth}")
        self.options = replace(options, virtual_stages=virtual_stages)
        self.layers = layers
        self.devices = list(devices)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.optimizer = optimizer
        self.overhead = float(overhead)
        self.data_parallel = data_parallel
        self.allreduce_bandwidth = allreduce_bandwidth
        self.virtual_stages = virtual_stages
        self.zero = options.zero
        self.shard_over = options.shard_over
        # ZeRO-1 and above shard the optimizer state (what plans record).
        self.shard_optimizer = self.zero >= 1
        self.shared = shared_groups(self.devices, colocated)
        # Per position 0..L, whether a stage may not start there: every solver honours it.
        self.forbidden = forbidden_cuts(layers.tied, len(layers), forbidden)
        self.restricted = bool(self.forbidden.any())
        if self.shared and (virtual_stages > 1 or schedule == "zb" or data_parallel > 1):
            raise ValueError(
                "stages sharing a device are planned for the single-process GPipe, which runs "
                "neither virtual stages, zero bubble nor replicas; give each stage its own "
                "device or plan for ranks"
            )
        # Bytes a stage holds per parameter byte: weight, gradient and its optimizer state.
        self.state_factor = state_factor(optimizer, self.zero, self.shard_over)
        # The routed experts' state shards over the devices holding the same experts.
        self.expert_factor = state_factor(
            optimizer, self.zero, options.mesh.expert_replicas(data_parallel)
        )
        self.expert_state = (
            None
            if layers.experts is None
            else layers.experts * (self.expert_factor - self.state_factor)
        )
        # Stage k runs on rank k % K as local stage k // K (or in a V: rank r holds r and
        # 2K−1−r); one replay of each rank's order.
        ranks = len(self.devices) // virtual_stages
        self.placement = stage_placement(len(self.devices), ranks, schedule)
        held = [in_flight(r, ranks, virtual_stages, chunks, schedule) for r in range(ranks)]
        self._in_flight = [0] * len(self.devices)
        for r in range(ranks):
            for local, k in enumerate(rank_stages(r, ranks, virtual_stages, schedule)):
                self._in_flight[k] = held[r][local]
        # Per rank, the shares of its stages' peaks it holds at once (its stages do not
        # peak together); one stage per rank: that stage's peak.
        self._shares = [
            held_shares(r, ranks, virtual_stages, chunks, schedule) for r in range(ranks)
        ]
        # Per rank, its peak over the sum of its stages' peaks for stages alike: what of a
        # stage's activations counts against its share of the device when it chooses what
        # to keep (1 with one stage per rank).
        self._rank_share = [
            float((shares @ np.asarray(peaks, dtype=float)).max() / max(sum(peaks), 1))
            for shares, peaks in zip(self._shares, held, strict=True)
        ]
        # Under split backward (zero bubble) a re-computed micro-batch keeps its reduced set
        # until its input gradient and its full set until its weights' (split_holding).
        self.split_backward = schedule in SPLIT_SCHEDULES
        self._moments = (
            [split_moments(r, ranks, virtual_stages, chunks, schedule) for r in range(ranks)]
            if self.split_backward
            else []
        )
        self._pairs: list[tuple[tuple[int, int], ...]] = [((0, 0),)] * len(self.devices)
        self._keeps = list(self._pairs)
        if self.split_backward:
            for r in range(ranks):
                pairs = stage_holdings(r, ranks, virtual_stages, chunks, schedule)
                keeps = stage_keeps(r, ranks, virtual_stages, chunks, schedule)
                for local, k in enumerate(rank_stages(r, ranks, virtual_stages, schedule)):
                    self._pairs[k] = pairs[local]
                    self._keeps[k] = keeps[local]
        # Bytes the backward re-builds beyond the saved sets (re-computed modules' outputs):
        # under split backward held from a micro-batch's I until its W with its full set;
        # under a whole backward only while it runs, which the layers' peaks price.
        rebuilt = layers.rebuilt if self.split_backward else None
        self.rebuilds = rebuilt is not None and bool(np.any(rebuilt > 0))
        self.rebuilt_sums = prefix_sums(rebuilt if rebuilt is not None else np.zeros(len(layers)))
        # ``auto``: keep everything, else the other fixed mode (except_last; ``always``
        # under split backward, which has no except_last), else re-computed units.
        if checkpoint != "auto":
            self.modes: tuple[str, ...] = (checkpoint,)
        elif self.split_backward:
            self.modes = ("never", "always")
        else:
            self.modes = FIXED_CHECKPOINT_MODES[:2]
        self._fwd = prefix_sums(layers.forward)
        self._bwd = prefix_sums(layers.backward)
        if layers.backward_input is not None:  # measured: the rest is the weights'
            weight = np.maximum(layers.backward - layers.backward_input, 0.0)
        else:
            weight = np.where(layers.params > 0, _WEIGHT_SHARE * layers.backward, 0.0)
        self._weight = prefix_sums(weight)
        # Saved bytes less what the previous layer also saves; a stage's first layer adds
        # its shared part back (its predecessor is not in the stage).
        self._shared = layers.shared_bytes
        self._saved = prefix_sums(layers.saved - self._shared)
        self._params = prefix_sums(layers.params)
        state = layers.params * self.state_factor + layers.buffers
        self._state = prefix_sums(state if self.expert_state is None else state + self.expert_state)
        # Per tied tensor, how many of its users lie before each layer: a stage [s, e)
        # holds cnt[e] − cnt[s] of them, and counts the tensor once instead.
        self.tied = list(layers.tied)
        n = len(layers)
        self._tied_users = np.zeros((len(self.tied), n + 1))
        for i, item in enumerate(self.tied):
            used = np.zeros(n)
            used[list(item.layers)] = 1.0
            self._tied_users[i] = prefix_sums(used)
        self._tied_params = np.array([0.0 if t.buffer else float(t.bytes) for t in self.tied])
        self._tied_state = np.array(
            [float(t.bytes) * (1.0 if t.buffer else self.state_factor) for t in self.tied]
        )
        # Boundary input of a stage starting at s: the model input or layer s−1's output.
        self._inputs = np.concatenate([[layers.input], layers.output])
        self._sends = np.concatenate([[0.0], layers.output[:-1], [0.0]])
        # Re-built bytes held with the full sets are not held again as a transient peak.
        peak = np.maximum(layers.peak - rebuilt, 0.0) if rebuilt is not None else layers.peak
        self.peaks = RangeMax(peak) if np.any(peak > 0) else None
        # ``auto``: the cheapest units to re-compute in a stage keeping all would overflow.
        self.units = UnitRecompute.of(layers)
        # Under dualpipev the all-to-alls are kept apart too: its overlapped pairs hide them.
        self.overlapped = schedule == "dualpipev" and layers.alltoall_forward is not None
        self._comm = [
            prefix_sums(figure if figure is not None and self.overlapped else np.zeros(n))
            for figure in (layers.alltoall_forward, layers.alltoall_backward)
        ]
        # :meth:`_costs` of single stages, by ``(k, s, e)``.
        self._one_stage: dict[tuple[int, int, int], tuple[Array, Array, Index, Array, Array]] = {}

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fraction(self, mode: str) -> float:
        """Share of micro-batches whose forward runs again in backward under ``mode``."""
        m = self.chunks
        return {"always": 1.0, "except_last": (m - 1) / m, "never": 0.0}[mode]

    @property
    def recompute_fraction(self) -> float:
        """Re-computed share of micro-batches (``auto``: of its fastest mode, ``never``)."""
        return self.fraction(self.modes[0])

    @property
    def num_ranks(self) -> int:
        """Devices of one pipeline: the stages over the virtual stages per rank."""
        return self.num_stages // self.virtual_stages

    def in_flight(self, k: int) -> int:
        """Micro-batches whose activations stage ``k`` holds at its peak."""
        return self._in_flight[k]

    def checkpointed(self, k: int, mode: str | None = None) -> tuple[int, int]:
        """``(ck, keep)``: in-flight micro-batches stored as inputs only, and as saved sets.

        Args:
            k: the stage.
            mode: a fixed mode; default the model's (required when it is ``auto``).
        """
        mode = mode or self.checkpoint
        if mode == "auto":
            raise ValueError("checkpoint mode auto decides per stage: pass the mode")
        n = self.in_flight(k)
        ck = {"always": n, "except_last": min(n, self.chunks - 1), "never": 0}[mode]
        return ck, max(n - ck, 1)

    def holding(self, k: int, mode: str | None = None) -> Holding:
        """How stage ``k``'s micro-batches hold their activations at its candidate peaks.

        The stage's activations peak at the largest ``c·in(s) + y·S(s, e)`` over the
        returned pairs ``(c, y)`` under a fixed ``mode`` (``c`` micro-batches keep their
        boundary input, ``y`` their saved set); under ``units`` ``c`` keep their reduced
        sets (:class:`~autopipe.planning.model.unit_recompute.Holding`).

        Args:
            k: the stage.
            mode: a fixed mode or ``units``; default the model's (required when ``auto``).
        """
        mode = mode or self.checkpoint
        n = self.in_flight(k)
        if mode == UNITS_MODE:
            if self.split_backward:
                return Holding(n, self._pairs[k], transient=False)
            return Holding.whole(n)
        if self.split_backward and mode == "never" and self.rebuilds:
            # ``never`` re-building bytes: ``c`` keep their saved set, ``y`` it and what
            # their I re-built (split_holding's stage_keeps).
            return Holding(n, self._keeps[k])
        if self.split_backward and mode != "auto":
            # ``never``: every micro-batch in flight keeps its saved set until its W.
            return Holding(n, self._pairs[k] if mode == "always" else ((0, n),))
        return Holding(n, (self.checkpointed(k, mode),))

    def rank_moments(self, rank: int) -> NDArray[np.int64]:
        """Under split backward, the counts ``rank``'s stages hold at each moment that may
        set its peak (:func:`~autopipe.planning.schedules.split_holding.split_moments`;
        the rank's stages in local order, three columns each); no rows otherwise."""
        if not self.split_backward:
            return np.zeros((0, 3 * self.virtual_stages), dtype=np.int64)
        return self._moments[rank]

    def layer_time(self) -> Array:
        """Per-layer cost per micro-batch on a speed-1 device, transfers excluded."""
        return self.layers.forward * (1.0 + self.recompute_fraction) + self.layers.backward

    def transfer_time(self, k: int, e: Index) -> Array:
        device = self.devices[k]
        if device.bandwidth is None and not device.latency:
            return np.zeros(np.shape(e))
        # A stage ending at e sends layer e−1's output, unless it is the last stage.
        sends = self._sends[e]
        volume = sends / device.bandwidth if device.bandwidth is not None else 0.0 * sends
        return np.where(np.asarray(e) < self.num_layers, volume + device.latency, 0.0)

    def _repeats(self, weights: Array, s: Index, e: Index) -> Array:
        """``Σ_t weights_t · (users of t in [s, e) − 1)⁺``: tied bytes counted twice."""
        total = np.zeros(np.broadcast(np.asarray(s), np.asarray(e)).shape)
        for users, weight in zip(self._tied_users, weights, strict=True):
            total = total + weight * np.maximum(users[e] - users[s] - 1.0, 0.0)
        return total

    def holds_tied(self, s: Index, e: Index) -> list[NDArray[np.bool_]]:
        """Per tied tensor, whether a stage of layers ``[s, e)`` holds a copy of it."""
        return [users[e] - users[s] > 0 for users in self._tied_users]

    def state_memory(self, s: Index, e: Index) -> Array:
        """Parameters, gradients, optimizer state (a 1/D share when sharded) and buffers of
        layers ``[s, e)``."""
        state = self._state[e] - self._state[s]
        if self.tied:
            state = state - self._repeats(self._tied_state, s, e)
        return state

    def _passes(self, s: Index, e: Index) -> tuple[Array, Array]:
        """Forward and backward of layers ``[s, e)`` per micro-batch on a speed-1 device,
        with what the stage's exchanges expose (``layers.exposure``)."""
        fwd = self._fwd[e] - self._fwd[s]
        bwd = self._bwd[e] - self._bwd[s]
        if self.layers.exposure is not None:
            extra_fwd, extra_bwd = self.layers.exposure.exposed(s, e)
            fwd, bwd = fwd + extra_fwd, bwd + extra_bwd
        return fwd, bwd

    def _work(self, k: int, s: Index, e: Index, mode: str) -> Array:
        fwd, bwd = self._passes(s, e)
        return (fwd * (1.0 + self.fraction(mode)) + bwd) / self.devices[k].speed

    def _full_set(self, s: Index, e: Index) -> Array:
        """Bytes one micro-batch saves for the backward of layers ``[s, e)``."""
        return np.asarray(self._saved[e] - self._saved[s] + self._shared[s])

    def rebuilt_set(self, s: Index, e: Index) -> Array:
        """Bytes one micro-batch's backward of layers ``[s, e)`` re-builds and holds with
        its saved set until its weights' gradients (0 unless the backward is split)."""
        return np.asarray(self.rebuilt_sums[e] - self.rebuilt_sums[s])

    def _saved_sets(self, k: int, s: Index, e: Index, mode: str) -> Array:
        saved = self._full_set(s, e)
        reduced = saved if mode == "never" else self._inputs[s]
        full = saved + self.rebuilt_set(s, e) if self.rebuilds else saved
        pairs = self.holding(k, mode).pairs
        held = pairs[0][0] * reduced + pairs[0][1] * full
        for c, y in pairs[1:]:
            held = np.maximum(held, c * reduced + y * full)
        return np.asarray(held)

    def stage_costs(self, k: int, s: Index, e: Index) -> tuple[Array, Array, Index]:
        """``(time, memory, mode)`` of stage ``k`` holding layers ``[s, e)``.

        ``mode`` indexes :attr:`modes`, or is :data:`UNITS` for a set of re-computed units
        (``auto``): the fastest whose memory fits, else the one that needs the least memory.
        """
        time, memory, choice, _, _ = self._costs(k, s, e)
        return time, memory, choice

    def _costs(self, k: int, s: Index, e: Index) -> tuple[Array, Array, Index, Array, Array]:
        """:meth:`stage_costs`, the seconds per micro-batch of its re-computed units and
        the bytes a micro-batch keeps until its backward (its reduced set)."""
        if np.ndim(s) or np.ndim(e):
            return self._stage_costs(k, s, e)
        # The solvers price one stage at a time over and over (each split they compare
        # shares most stages with the last): a stage is priced once.
        key = (k, int(s), int(e))
        found = self._one_stage.get(key)
        if found is None:
            found = self._stage_costs(k, s, e)
            for part in found:
                if isinstance(part, np.ndarray):
                    part.flags.writeable = False  # shared by every caller
            self._one_stage[key] = found
        return found

    def _stage_costs(self, k: int, s: Index, e: Index) -> tuple[Array, Array, Index, Array, Array]:
        state = self.held_state(s, e)
        fixed = self.overhead + self.transfer_time(k, e)
        cap, share = self._budget(k)
        # The bytes of activations the stage may keep: its share of the device less its
        # state, over the share of its activations that counts against it.
        budget = (cap - state) / share
        time = self._work(k, s, e, self.modes[0]) + fixed
        kept = self._saved_sets(k, s, e, self.modes[0])
        memory = state + kept
        choice = np.zeros(np.shape(memory), dtype=np.int64)
        units = np.zeros(np.shape(memory))
        reduced = self._reduced(s, e, self.modes[0])
        if self.checkpoint == "auto" and math.isfinite(cap) and np.any(kept > budget):
            # Where keeping everything is over: the cheapest set of units to re-compute.
            shape = np.broadcast(np.asarray(s), np.asarray(e), time, memory).shape
            time, memory, state, kept, budget, reduced = (
                np.broadcast_to(a, shape).astype(float)
                for a in (time, memory, state, kept, budget, reduced)
            )
            choice, units = np.zeros(shape, dtype=np.int64), np.zeros(shape)
            over = kept > budget
            s_over, e_over = (np.broadcast_to(a, shape)[over] for a in (s, e))
            holding = self.holding(k, UNITS_MODE)
            rebuilt = self.rebuilt_set(s_over, e_over)
            extra, held, left, _ = self.units.choose(s_over, e_over, holding, budget[over], rebuilt)
            units[over] = extra / self.devices[k].speed
            time[over] += units[over]
            memory[over] = state[over] + held
            kept[over] = held
            reduced[over] = left
            choice[over] = UNITS
        for i, mode in enumerate(self.modes[1:], start=1):
            other_kept = self._saved_sets(k, s, e, mode)
            other = state + other_kept
            other_time = self._work(k, s, e, mode) + fixed
            # Both fit: the faster; else the one that fits, else the one needing less.
            fits, other_fits = kept <= budget, other_kept <= budget
            take = np.where(
                fits & other_fits, other_time < time, ~fits & (other_fits | (other < memory))
            )
            time = np.where(take, other_time, time)
            memory = np.where(take, other, memory)
            kept = np.where(take, other_kept, kept)
            choice = np.where(take, i, choice)
            units = np.where(take, 0.0, units)
            reduced = np.where(take, self._reduced(s, e, mode), reduced)
        return time, memory, choice, units, reduced

    def _reduced(self, s: Index, e: Index, mode: str) -> Array:
        """Bytes a micro-batch keeps until its backward under a fixed mode: its boundary
        input where it is re-computed, else its saved set (``except_last`` spares one
        micro-batch; the reduced set is that of the others)."""
        return self._inputs[s] if mode != "never" else self._full_set(s, e)

    def _budget(self, k: int) -> tuple[float, float]:
        """The memory stage ``k`` chooses its checkpointing within, and the share of its
        activations that counts against it.

        A device holding v stages gives each a v-th of itself; its stages do not peak
        together, so a stage's activations count at the rank's peak over their summed
        peaks (:attr:`_rank_share`). The rank's own check then takes its stages together
        (:func:`~autopipe.planning.model.spans.rank_memory`).
        """
        if self.virtual_stages == 1:
            return self.capacity(k), 1.0
        share = self._rank_share[self.placement[k]]
        return self.capacity(k) / self.virtual_stages, max(share, 1e-9)

    def stage_parts(self, k: int, s: Index, e: Index) -> StageParts:
        """Stage ``k``'s parts with layers ``[s, e)``, as the step replay takes them.

        One forward and one backward per micro-batch, the executor's overhead shared
        between them in their proportion (so that ``forward·(1 + r) + backward + transfer``
        is :meth:`stage_time`, ``r`` the re-computed share), the re-computation as a
        :data:`autopipe.planning.schedules.schedule_replay.RECOMPUTE_CODES` value, and the stage's
        memory (:meth:`stage_memory`), all from one :meth:`stage_costs`.
        """
        time, memory, choice, units, reduced = self._costs(k, s, e)
        speed = self.devices[k].speed
        fwd, bwd = (part / speed for part in self._passes(s, e))
        # The weights' share of the backward, re-computed units not counted: they run
        # again with the input's gradient (before it, under split backward).
        own = bwd
        weight = self.weight_share(s, e) * own
        # Re-computed units run again in the backward of every micro-batch.
        bwd = bwd + units
        transfer = self.transfer_time(k, e)
        fractions = self._fractions(choice)
        work = fwd * (1.0 + fractions) + bwd
        compute = time - transfer
        # Layers of no measurable time: the overhead goes to the forward and backward alike.
        safe = np.where(work > 0, work, 1.0)
        scale = np.where(work > 0, compute / safe, 1.0)
        even = np.where(work > 0, 0.0, compute / (2.0 + fractions))
        codes = np.array([RECOMPUTE_CODES[mode] for mode in (*self.modes, "never")])[choice]
        backward = bwd * scale + even
        share = np.where(backward > 0, weight * scale / np.where(backward > 0, backward, 1.0), 0.0)
        full = self._full_set(s, e) + self.rebuilt_set(s, e)
        recomputed = np.array([mode != "never" for mode in (*self.modes, UNITS_MODE)])[choice]
        again = np.where(recomputed, reduced, 0.0)
        held = np.stack(np.broadcast_arrays(reduced, full, again), axis=-1)
        forward = fwd * scale + even
        comm_fwd, comm_bwd = self.alltoall_time(k, s, e)
        return StageParts(
            forward,
            backward,
            transfer,
            codes,
            memory,
            share,
            held,
            np.minimum(comm_fwd, forward),
            np.minimum(comm_bwd, backward),
        )

    def alltoall_time(self, k: int, s: Index, e: Index) -> tuple[Array, Array]:
        """Seconds of stage ``k``'s all-to-alls per forward and per backward with layers
        ``[s, e)`` that ``dualpipev``'s overlapped pairs may hide (parts of its times);
        zeros under other schedules and without expert parallelism."""
        speed = self.devices[k].speed
        forward, backward = (np.asarray(c[e] - c[s]) / speed for c in self._comm)
        return forward, backward

    def weight_share(self, s: Index, e: Index) -> Array:
        """Share of layers ``[s, e)``'s backward that computes their weights' gradients."""
        _, backward = self._passes(s, e)
        # What the exchanges expose waits with the weights' part (the input's gradient
        # carries only the tensor- and context-parallel collectives).
        weight = self._weight[e] - self._weight[s] + backward - (self._bwd[e] - self._bwd[s])
        return np.where(backward > 0, weight / np.where(backward > 0, backward, 1.0), 0.0)

    def stage_checkpoint(self, k: int, s: int, e: int) -> str:
        """The checkpoint mode stage ``k`` runs with when it holds layers ``[s, e)``:
        ``units`` when it re-computes a set of its units (:meth:`recompute_units`)."""
        if len(self.modes) == 1:
            return self.modes[0]
        choice = int(self.stage_costs(k, np.array(s), np.array(e))[2])
        return UNITS_MODE if choice == UNITS else self.modes[choice]

    def recompute_units(self, k: int, s: int, e: int) -> list[int]:
        """The layers stage ``k`` re-computes on every micro-batch when it holds layers
        ``[s, e)`` and runs in mode ``units`` (else none)."""
        if self.stage_checkpoint(k, s, e) != UNITS_MODE:
            return []
        state = float(self.held_state(np.array(s), np.array(e)))
        cap, share = self._budget(k)  # as stage_costs chose them
        rebuilt = float(self.rebuilt_set(np.array(s), np.array(e)))
        holding = self.holding(k, UNITS_MODE)
        return self.units.units(s, e, holding, (cap - state) / share, rebuilt)

    def _fractions(self, choice: Index) -> Array:
        """Per mode index (:data:`UNITS` included), the share of micro-batches re-computed
        whole."""
        return np.array([*(self.fraction(mode) for mode in self.modes), 0.0])[choice]

    def stage_time(self, k: int, s: Index, e: Index) -> Array:
        """Cost per micro-batch of stage ``k`` holding layers ``[s, e)``."""
        return self.stage_costs(k, s, e)[0]

    def compute_time(self, k: int, s: Index, e: Index) -> Array:
        """Compute (re-computation and executor overhead included) per micro-batch."""
        return self.stage_time(k, s, e) - self.transfer_time(k, e)

    def recompute_time(self, k: int, s: Index, e: Index) -> Array:
        """Forward re-computation per micro-batch, averaged over the micro-batches."""
        _, _, choice, units, _ = self._costs(k, s, e)
        return self._fractions(choice) * self._passes(s, e)[0] / self.devices[k].speed + units

    def rank_shares(self, rank: int) -> NDArray[np.float64]:
        """Rows of the shares of ``rank``'s stages' saved sets it holds at once, its
        stages in :func:`~autopipe.planning.schedules.interleaving.rank_stages` order (see
        :func:`~autopipe.planning.schedules.interleaving.held_shares`)."""
        return self._shares[rank]

    def held_parts(self, k: int, s: Index, e: Index) -> Array:
        """Stage ``k``'s bytes per micro-batch with layers ``[s, e)`` as the rank's
        moments count them (last axis, :attr:`StageParts.held`)."""
        return self.stage_parts(k, s, e).held

    def saved_memory(self, k: int, s: Index, e: Index) -> Array:
        """Of stage ``k``'s peak with layers ``[s, e)``, the micro-batches' saved sets
        (and inputs kept for re-computation): what its in-flight micro-batches hold."""
        return self.stage_memory(k, s, e) - self.held_state(s, e)

    def held_state(self, s: Index, e: Index) -> Array:
        """Of a stage's peak with layers ``[s, e)``, what does not depend on the
        micro-batches in flight: its state and its largest transient."""
        state = self.state_memory(s, e)
        if self.peaks is not None:
            state = state + self.peaks.query(s, e)
        return state

    def activation_memory(self, k: int, s: Index, e: Index) -> Array:
        """Activations stage ``k`` holds at its peak with layers ``[s, e)``."""
        return self.stage_memory(k, s, e) - self.state_memory(s, e)

    def stage_memory(self, k: int, s: Index, e: Index) -> Array:
        """Peak bytes of stage ``k`` holding layers ``[s, e)``."""
        return self.stage_costs(k, s, e)[1]

    def capacity(self, k: int) -> float:
        memory = self.devices[k].memory
        return math.inf if memory is None else float(memory)

    @property
    def allreduce_factor(self) -> float:
        """Seconds per parameter byte of a stage's exchange after the drain:
        ``2·(S−1)/S / bandwidth`` for the all-reduce (see :func:`sync_factor`)."""
        return sync_factor(self.zero, self.shard_over, self.allreduce_bandwidth)

    def param_bytes(self, s: Index, e: Index) -> Array:
        """Parameter (and so gradient) bytes of layers ``[s, e)``, a tied one once."""
        params = self._params[e] - self._params[s]
        if self.tied:
            params = params - self._repeats(self._tied_params, s, e)
        return params

    def tied_times(self, balance: Sequence[int]) -> list[float]:
        """Per tied tensor, seconds per step to sum its copies' gradients under ``balance``
        (0 for buffers and for a tensor held by one stage)."""
        bounds = np.concatenate([[0], np.cumsum(balance)]).astype(np.int64)
        starts, ends = bounds[:-1], bounds[1:]
        times = []
        for item, held in zip(self.tied, self.holds_tied(starts, ends), strict=True):
            holders = [self.devices[k] for k in np.flatnonzero(held)]
            # A rank's virtual stages share one tensor: the ring runs between ranks.
            n = len({self.placement[int(k)] for k in np.flatnonzero(held)})
            if item.buffer or n < 2:
                times.append(0.0)
                continue
            links = [d.bandwidth for d in holders if d.bandwidth is not None]
            bandwidth = min(links) if links else self.allreduce_bandwidth
            volume = 2.0 * (n - 1) / n * item.bytes
            latency = 2.0 * (n - 1) * max(d.latency for d in holders)
            times.append((volume / bandwidth if bandwidth else 0.0) + latency)
        return times

    def tied_time(self, balance: Sequence[int]) -> float:
        """Seconds per step to sum the gradients of every tied parameter's copies."""
        return float(sum(self.tied_times(balance)))

    def allreduce_time(self, s: Index, e: Index) -> Array:
        """Seconds per step to all-reduce the gradients of a stage holding ``[s, e)``."""
        return self.allreduce_factor * self.param_bytes(s, e)

    @property
    def update_factor(self) -> float:
        """Seconds of the optimizer's step per parameter byte of a stage (calibrated)."""
        return self.layers.update_per_byte

    def update_time(self, s: Index, e: Index) -> Array:
        """Seconds per step of the optimizer's step on a stage holding ``[s, e)``."""
        return self.update_factor * self.param_bytes(s, e)

    @property
    def step_factor(self) -> float:
        """Seconds per step per parameter byte of the stage with the most: its gradients'
        all-reduce and its optimizer's step, which follow its last backward."""
        return self.allreduce_factor + self.update_factor

    def signature(self, k: int) -> tuple[object, ...]:
        """Stages with equal signatures have identical cost and memory functions."""
        device = self.devices[k]
        modes = tuple(self.holding(k, mode) for mode in self.modes)
        if self.checkpoint == "auto":
            modes += (self.holding(k, UNITS_MODE),)
        return (device.speed, device.bandwidth, device.latency, modes, self.capacity(k))

    def sum_is_invariant(self) -> bool:
        """Whether ``Σ_k c_k`` is the same for every split (equal speeds, free transfers)."""
        speeds = {d.speed for d in self.devices}
        fixed = len(self.modes) == 1 or all(d.memory is None for d in self.devices)
        free = all(d.bandwidth is None and not d.latency for d in self.devices)
        # Exchanges exposed at the stages' ends add more the more cuts there are.
        return len(speeds) == 1 and fixed and free and self.layers.exposure is None
