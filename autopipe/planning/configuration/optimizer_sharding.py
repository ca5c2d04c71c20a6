"""Whether a searched configuration needs its optimizer state sharded (ZeRO-1), in words.

:func:`autopipe.search` with ``shard_optimizer=True`` or ``"auto"`` values every
configuration of D > 1 replicas with each stage's optimizer state sharded over them (a
stage holds ``opt / D`` state bytes per parameter byte, see
:mod:`autopipe.planning.model.cost_model`). Sharding never costs step time in the model and only
frees memory, so that optimum is the best of both ways. Each returned plan is then compared
with the same configuration unsharded: under ``"auto"`` a plan that loses nothing
unsharded is returned unsharded, and a plan that needs sharding says why (unsharded it does
not fit, or runs slower).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopipe import PlanningError
from autopipe.planning.configuration.search_space import Config, Space
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.quantities import format_time
from autopipe.planning.model.spans import split_fits, stage_bounds
from autopipe.planning.planner import interleaved_balance
from autopipe.planning.split.exact import solve_split, split_value
from autopipe.planning.split.interleaved_balance import pipeline_time
from autopipe.planning.split.tolerances import SAME_TIME

__all__: list[str] = []

# What ``shard_optimizer`` of :func:`autopipe.search` takes.
SHARD_CHOICES = (False, True, "auto")
_UNNEEDED = "it fits as fast without sharding (ZeRO-1 not needed)"


def check_shard_optimizer(value: object) -> bool | str:
    """``value`` if it is one of :data:`SHARD_CHOICES`.

    Raises:
        ValueError: anything else (``"yes"``, 1, ...).
    """
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(
        f"shard_optimizer must be True, False or 'auto' (try both and keep sharding only "
        f"where it is needed), got {value!r}"
    )


@dataclass(frozen=True)
class Settled:
    """A searched configuration's plan as returned: its model, its split, and a note on
    its sharding (why it shards, or under ``"auto"`` that it need not; empty when there is
    nothing to say)."""

    model: CostModel
    balance: list[int]
    note: str = ""


def step_value(model: CostModel, balance: list[int]) -> float:
    """The step time the search values ``balance`` at: the replayed schedule's with
    virtual stages, else the exact solver's objective."""
    if model.virtual_stages == 1:
        return split_value(model, balance)
    bounds = stage_bounds(balance)
    allreduce = max(
        float(model.allreduce_time(bounds[k], bounds[k + 1])) for k in range(len(balance))
    )
    return pipeline_time(model, balance) + allreduce + model.tied_time(balance)


def _unsharded_best(model: CostModel, limit: float) -> tuple[float, list[int]] | None:
    """The best split unsharded (a bound from below when it is at or above ``limit``), or
    ``None`` when none fits."""
    if model.virtual_stages == 1:
        return solve_split(model, limit)
    try:
        balance = interleaved_balance(model)
    except PlanningError:
        return None
    return step_value(model, balance), balance


def settle(
    space: Space, config: Config, model: CostModel, balance: list[int], auto: bool
) -> Settled:
    """The plan of a configuration searched with its optimizer state sharded.

    Args:
        space: the search space (its models shard).
        config: the configuration.
        model: its sharded cost model.
        balance: the best split found for it.
        auto: return it unsharded when that loses nothing (else it stays sharded, with a
            note only where sharding is needed).
    """
    if not model.shard_optimizer or config.replicas == 1 or config.zero >= 0:
        return Settled(model, balance)  # a ZeRO stage searched as such stays
    value = step_value(model, balance)
    limit = value * (1 + SAME_TIME)
    plain = space.model(config, shard=False)
    if split_fits(plain, balance) and step_value(plain, balance) <= limit:
        same = balance
    else:
        found = _unsharded_best(plain, limit)
        if found is None:
            return Settled(model, balance, _needed(config, "it does not fit"))
        if found[0] > limit:
            slower = f"a step takes at least {format_time(found[0])}, not {format_time(value)}"
            return Settled(model, balance, _needed(config, slower))
        same = found[1]
    if auto:
        return Settled(plain, same, f"optimizer state not sharded: {_UNNEEDED}")
    return Settled(model, balance)


def _needed(config: Config, why: str) -> str:
    return f"optimizer state sharded over {config.replicas} replicas (ZeRO-1): unsharded {why}"
