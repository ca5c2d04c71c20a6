"""Per-layer time factors fitted on pipeline steps timed where they ran.

A profile times every layer alone, in one process; a pipeline runs each stage on its own
rank, bound to its own cores, beside the other stages and the runtime's messages. What a
layer costs there is what a stage's forward and backward take in the pipeline's own first
steps. Each such step gives, per stage, the seconds of one forward and of one backward per
micro-batch (:func:`autopipe.distributed.step_trace.stage_seconds`); this module turns them
into a factor per layer and figure, ``meta["calibration"]["layer_scales"]``, that the
planner multiplies every layer's time by (:class:`~autopipe.planning.model.layer_costs.
ProfileLines`), so that every split — the measured ones and any other — is predicted
from them and planned again.

The unknowns are one factor per *segment*: the runs of layers that no measured split cuts.
A stage is a union of segments, so each stage gives one equation, and K stages of S splits
give S·K equations for at most S·(K−1)+1 segments: always enough. They are solved by
non-negative least squares on relative errors, forward first (the backward of a stage that
re-computes holds one more forward).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import nnls

from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.plans import Plan
from profiler import Profile

__all__ = [
    "StageSeconds",
    "fit_layer_scales",
    "fit_update",
    "scaled_profile",
    "stage_param_bytes",
    "uniform_scales",
]

Array = NDArray[np.float64]
# A factor beyond these is a measurement gone wrong (a stalled rank), not a slow layer.
_LOWEST, _HIGHEST = 0.05, 20.0


@dataclass(frozen=True)
class StageSeconds:
    """A split's step timed where it ran: per stage, the seconds per micro-batch.

    Attributes:
        plan: the split's plan, predicted from the profile the fit refines.
        forward: per stage, one forward's seconds.
        backward: per stage, one backward's seconds (its re-computation included).
    """

    plan: Plan
    forward: Sequence[float]
    backward: Sequence[float]


def _segments(observed: Sequence[StageSeconds], layers: int) -> list[int]:
    cuts = {0, layers}
    for seen in observed:
        cuts.update(stage.start for stage in seen.plan.stages)
    return sorted(cuts)


def _solve(rows: list[Array], targets: list[float]) -> Array:
    """Non-negative factors of ``rows · x ≈ targets``, each row weighted by its target;
    a factor no row constrains (or one the fit drove to 0) is the overall ratio."""
    design, goal = np.array(rows), np.array(targets)
    keep = goal > 0
    overall = goal[keep].sum() / max(design[keep].sum(), 1e-30)
    factors = np.full(design.shape[1], overall)
    if keep.any():
        weights = 1.0 / goal[keep]
        found, _ = nnls(design[keep] * weights[:, None], np.ones(int(keep.sum())))
        seen = design[keep].sum(axis=0) > 0
        factors[seen] = np.where(found[seen] > 0, found[seen], overall)
    return np.clip(factors, _LOWEST, _HIGHEST)


def fit_layer_scales(profile: Profile, observed: Sequence[StageSeconds]) -> dict[str, Array]:
    """The per-layer forward and backward factors that make the observed steps' stages
    take what they measured.

    Args:
        profile: the profile the observed plans were predicted from (its own calibration,
            layer factors included, stays: the new factors multiply it).
        observed: one or more splits' timed stages.

    Returns:
        ``{"forward": factors, "backward": factors}``, one per layer each.

    Raises:
        ValueError: nothing observed, or an observation that does not match its plan.
    """
    if not observed:
        raise ValueError("no timed stages to fit the layers' factors on")
    n = len(profile)
    bounds = _segments(observed, n)
    lines = ProfileLines.from_profile(profile)
    forward_rows: list[Array] = []
    forward_goals: list[float] = []
    backward_rows: list[tuple[Array, Array]] = []
    backward_goals: list[float] = []
    for seen in observed:
        stages = seen.plan.stages
        if len(seen.forward) != len(stages) or len(seen.backward) != len(stages):
            raise ValueError(
                f"{len(seen.forward)} timed stages for a plan of {len(stages)}: time every stage"
            )
        plan = seen.plan
        time_batch = plan.batch_size / plan.chunks if plan.batch_size else plan.micro_batch
        costs = lines.at(plan.micro_batch, time_batch)
        for stage, forward, backward in zip(stages, seen.forward, seen.backward, strict=True):
            speed = plan.devices[stage.index].speed if stage.index < len(plan.devices) else 1.0
            f_row, b_row = np.zeros(len(bounds) - 1), np.zeros(len(bounds) - 1)
            for k in range(len(bounds) - 1):
                lo, hi = max(bounds[k], stage.start), min(bounds[k + 1], stage.stop)
                if lo < hi:
                    f_row[k] = costs.forward[lo:hi].sum() / speed
                    b_row[k] = costs.backward[lo:hi].sum() / speed
            # What the plan adds to the layers' sums: the runtime's cost per micro-batch,
            # split between the forward and the backward as the plan split it.
            forward_extra = max(stage.forward - f_row.sum(), 0.0)
            backward_extra = max(stage.overhead - forward_extra, 0.0)
            forward_rows.append(f_row)
            forward_goals.append(forward - forward_extra)
            # The share of micro-batches whose forward runs again, as the plan counted it.
            again = stage.recompute / f_row.sum() if f_row.sum() > 0 else 0.0
            backward_rows.append((b_row, again * f_row))
            backward_goals.append(backward - backward_extra)
    forward_factor = _solve(forward_rows, forward_goals)
    # The re-computation inside a backward is a forward: take it out at its fitted cost.
    goals = [
        goal - float(again @ forward_factor)
        for goal, (_, again) in zip(backward_goals, backward_rows, strict=True)
    ]
    backward_factor = _solve([row for row, _ in backward_rows], goals)
    sizes = np.diff(bounds)
    return {
        "forward": np.repeat(forward_factor, sizes),
        "backward": np.repeat(backward_factor, sizes),
    }


def stage_param_bytes(profile: Profile, start: int, stop: int) -> float:
    """Parameter bytes of layers ``[start, stop)`` as the profile counts them."""
    return float(sum(layer.param_bytes for layer in profile.layers[start:stop]))


def fit_update(timed: Sequence[tuple[float, float]]) -> float:
    """Seconds of the optimizer's step per parameter byte: the least-squares line through
    the origin of ``(parameter bytes, seconds)`` pairs, each a stage's (or a process's)
    optimizer step timed where it ran; 0 when no pair holds parameters."""
    volume = sum(size * size for size, _ in timed)
    if volume <= 0:
        return 0.0
    return max(sum(size * seconds for size, seconds in timed) / volume, 0.0)


def uniform_scales(profile: Profile, factor: float) -> dict[str, Array]:
    """One ``factor`` for every layer's forward and backward."""
    if not (np.isfinite(factor) and factor > 0):
        raise ValueError(f"a layer time factor must be a positive number, got {factor}")
    ones = np.full(len(profile), float(factor))
    return {"forward": ones, "backward": ones.copy()}


def scaled_profile(
    profile: Profile,
    scales: dict[str, Array],
    source: str,
    update_per_byte: float | None = None,
) -> Profile:
    """A copy of ``profile`` whose layers' times carry ``scales`` on top of its own.

    Args:
        profile: the profile (left unchanged).
        scales: per figure, one factor per layer (:func:`fit_layer_scales`).
        source: how the factors were measured, kept beside them for the report.
        update_per_byte: seconds of the optimizer's step per parameter byte
            (:func:`fit_update`), or ``None``: the profile's own.
    """
    out = copy.deepcopy(profile)
    found = out.meta.get("calibration") if isinstance(out.meta, dict) else None
    calibration = dict(found) if isinstance(found, dict) else {}
    before = ProfileLines.from_profile(profile).layer_scale
    combined = {
        figure: (before[figure] * values if figure in before else values)
        for figure, values in scales.items()
    }
    calibration["layer_scales"] = {k: [float(x) for x in v] for k, v in combined.items()}
    calibration["layer_scales_source"] = source
    if update_per_byte is not None:
        calibration["update_s_per_byte"] = float(update_per_byte)
    out.meta["calibration"] = calibration
    return out
