"""A profile's counts and shard counts as arrays (layers × batch sizes), and the refusals.

The per-degree figures (:mod:`autopipe.planning.mesh.degree_figures`) read every layer's
counted FLOPs and traffic and its :class:`profiler.shard_counts.ShardCounts` at each
measured batch size; this gathers them once per profile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.mesh.expert_figures import ExpertTable
from autopipe.planning.model.layer_costs import saved_factor
from autopipe.planning.model.mesh import Mesh
from profiler import Profile

__all__: list[str] = []

Array = NDArray[np.float64]

# ShardCounts' per-size lists, and the layer's own counts, kept as arrays.
_SHARD_LISTS = (
    "flops", "backward_flops", "backward_input_flops", "traffic", "backward_traffic", "saved",
    "reduce_forward", "reduce_backward", "replicated_saved", "attention_flops",
    "attention_backward_flops", "kv_bytes",
)  # fmt: skip
_COUNTS = ("flops", "backward_flops", "backward_input_flops", "traffic", "backward_traffic")
_HOW = (
    "count the profile with the model's tensor-parallel plan (--tp-plan), or search "
    "tensor and context parallelism of 1"
)


@dataclass(frozen=True)
class Roofline:
    """The estimate a profile's times came from: ``max(F / (η_f·peak), T / (η_m·bw)) + o``
    per layer pass (:mod:`autopipe.planning.hardware.estimates`); a float8 estimate prices
    the attention FLOPs ``A`` of ``F`` at ``attention_peak_flops`` (bfloat16) instead:
    ``(F − A) / (η_f·peak) + A / (η_f·attention_peak)``."""

    peak_flops: float
    memory_bandwidth: float
    compute: float
    memory: float
    overhead: float
    # None: all FLOPs at peak_flops (estimates other than float8, and older records).
    attention_peak_flops: float | None = None

    def seconds(self, flops: Array, traffic: Array, attention: Array | None = None) -> Array:
        """Seconds per layer pass; ``attention``: of ``flops``, those at attention's peak."""
        if self.attention_peak_flops is None or attention is None:
            compute = flops / (self.compute * self.peak_flops)
        else:
            part = np.minimum(attention, flops)
            compute = (flops - part) / (self.compute * self.peak_flops) + part / (
                self.compute * self.attention_peak_flops
            )
        moved = traffic / (self.memory * self.memory_bandwidth)
        return np.asarray(np.maximum(compute, moved) + self.overhead)


def roofline_of(profile: Profile) -> Roofline | None:
    """The roofline ``meta["estimate"]`` records, or ``None`` for measured times (and for
    estimates made before the peaks were recorded)."""
    found = profile.meta.get("estimate") if isinstance(profile.meta, dict) else None
    if not isinstance(found, dict):
        return None
    efficiency = found.get("efficiency")
    figures = (found.get("peak_flops"), found.get("memory_bandwidth"))
    if not isinstance(efficiency, dict) or not all(
        isinstance(v, (int, float)) and v > 0 for v in figures
    ):
        return None
    attention = found.get("attention_peak_flops")
    try:
        return Roofline(
            float(figures[0]),  # type: ignore[arg-type]
            float(figures[1]),  # type: ignore[arg-type]
            float(efficiency["compute"]),
            float(efficiency["memory"]),
            float(efficiency["overhead"]),
            float(attention) if isinstance(attention, (int, float)) and attention > 0 else None,
        )
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class ShardTable:
    """Every layer's counts (``counts``) and shard counts (``shards``), layers × sizes.

    Attributes:
        names: the layers' names.
        kinds: their class names.
        counts: the layer's own FLOPs and traffic per pass (0 where not counted).
        shards: the :class:`profiler.shard_counts.ShardCounts` lists (0 without shards).
        sharded_params: per layer, the parameter bytes the plan shards.
        reductions: per layer, collectives per forward.
        attention_calls: per layer, attention calls per forward.
        heads: per layer, query heads (0: no attention).
        kv_heads: per layer, key/value heads.
        has_shards: per layer, whether it was counted with a tensor-parallel plan.
        roofline: the estimate behind the times, or ``None`` (measured).
        experts: the layers' routed experts, ``None`` when no layer has any.
    """

    names: list[str]
    kinds: list[str]
    counts: dict[str, Array]
    shards: dict[str, Array]
    sharded_params: Array
    reductions: Array
    attention_calls: Array
    heads: NDArray[np.int64]
    kv_heads: NDArray[np.int64]
    has_shards: NDArray[np.bool_]
    roofline: Roofline | None
    experts: ExpertTable | None = None

    @classmethod
    def from_profile(cls, profile: Profile) -> ShardTable:
        width = len(profile.batch_sizes)
        zeros = [0.0] * width
        layers = profile.layers
        counts = {
            what: np.array([getattr(x, what) or zeros for x in layers], dtype=float)
            for what in _COUNTS
        }
        shards = {
            what: np.array(
                [getattr(x.shards, what) if x.shards else zeros for x in layers], dtype=float
            )
            for what in _SHARD_LISTS
        }

        factor = saved_factor(profile)
        if factor is not None:  # the FP8 recipe's saved bytes, divided as the whole ones
            for what in ("saved", "replicated_saved"):
                shards[what] = shards[what] * factor

        def scalar(what: str) -> Array:
            return np.array([float(getattr(x.shards, what)) if x.shards else 0.0 for x in layers])

        return cls(
            names=[x.name for x in layers],
            kinds=[x.kind for x in layers],
            counts=counts,
            shards=shards,
            sharded_params=scalar("param_bytes"),
            reductions=scalar("reductions"),
            attention_calls=scalar("attention_calls"),
            heads=scalar("heads").astype(np.int64),
            kv_heads=scalar("kv_heads").astype(np.int64),
            has_shards=np.array([x.shards is not None for x in layers]),
            roofline=roofline_of(profile),
            experts=ExpertTable.from_profile(profile),
        )

    @property
    def attention_heads(self) -> int:
        """The largest query head count of any layer (0: no attention)."""
        return int(self.heads.max()) if len(self.heads) else 0

    def allowed_tensor(self, tensor: int) -> bool:
        """Whether every layer's heads split over ``tensor`` devices."""
        return self.refusal(Mesh(tensor=tensor)) is None

    def refusal(self, mesh: Mesh) -> str | None:
        """Why ``mesh`` cannot run this profile, in one line, or ``None``."""
        t = mesh.tensor
        if t == 1 and mesh.context == 1:
            return None
        missing = np.flatnonzero(~self.has_shards)
        if len(missing):
            i = int(missing[0])
            return (
                f"layer {i} ({self.kinds[i]} {self.names[i]!r}) has no shard counts, which "
                f"tensor parallelism {t} and context parallelism {mesh.context} need; {_HOW}"
            )
        for i, (heads, kv) in enumerate(zip(self.heads, self.kv_heads, strict=True)):
            where = f"layer {i} ({self.kinds[i]} {self.names[i]!r})"
            if heads and heads % t:
                return (
                    f"{where} has {heads} attention heads, which tensor parallelism {t} does "
                    f"not divide; choose a degree that divides {heads}"
                )
            if kv and (t % kv if kv < t else kv % t):
                return (
                    f"{where} has {kv} key/value heads, which tensor parallelism {t} neither "
                    "divides nor is a multiple of; choose another degree"
                )
        return None
