"""``plan``: a profile and devices in, the fastest split that fits out."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from autopipe import PlanningError
from autopipe.planning.mesh.degree_figures import uniform_mesh_lines
from autopipe.planning.model.colocation import device_count, shared_step_time
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.cut_rules import crossing
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.names import FIXED_CHECKPOINT_MODES, STRATEGIES
from autopipe.planning.model.plan_settings import PlanSettings, build_model, check_profile
from autopipe.planning.model.plans import Plan, StagePlan, TiedPlan
from autopipe.planning.model.quantities import format_bytes
from autopipe.planning.model.spans import (
    overflows,
    rank_memory,
    stage_bounds,
    stage_held,
    stage_saved,
    stage_spans,
)
from autopipe.planning.pipeline_settings import (
    CHUNKS_PER_STAGE,
    PLAN_FIELDS,
    PipelineSettings,
    default_chunks,
    with_overrides,
)
from autopipe.planning.recomputed_modules import planned_profile
from autopipe.planning.schedules.interleaving import rank_stages
from autopipe.planning.schedules.simulation import hidden_alltoalls
from autopipe.planning.split.balance import baseline_balance
from autopipe.planning.split.exact import check_cuts, gpipe_step_time, memory_split, optimal_split
from autopipe.planning.split.interleaved_balance import pipeline_time, timed_split
from profiler import Profile

__all__ = ["CHUNKS_PER_STAGE", "default_chunks", "evaluate", "plan"]


def plan(
    profile: Profile,
    devices: int | Sequence[DeviceSpec | str] = 2,
    settings: PipelineSettings | None = None,
    **overrides: Any,
) -> Plan:
    """Plans the pipeline with the smallest predicted step time that fits every device.

    The keywords below are the fields of :class:`PipelineSettings` that planning reads,
    laid over ``settings``; any other is refused (``TypeError``).

    Args:
        profile: per-layer measurements (see :func:`profiler.profile_model`).
        devices: the number of stages (identical devices named like the profile's), or one
            :class:`DeviceSpec` or device name per stage.
        settings: the settings to plan under (default: all defaults).
        chunks: micro-batches per mini-batch of one replica (default: the profile's).
        memory: capacity for every device, or one per device (bytes or ``16GiB``-style).
        checkpoint: ``always``, ``except_last``, ``never``, or ``auto``: each stage
            checkpoints only if it does not fit otherwise. Default: ``except_last``, or
            ``never`` for virtual stages and ``zb``
            (:func:`autopipe.planning.pipeline_settings.default_checkpoint`).
        schedule: ``gpipe`` (default) or ``1f1b``; sets how many micro-batches each stage
            holds.
        strategy: ``optimal`` (exact, default), or a peer's split computed as the peer
            computes it: ``uniform`` (DeepSpeed's ``partition_uniform``), ``parameters``
            (DeepSpeed's ``partition_method="parameters"``), ``blockpartition``
            (torchgpipe's ``balance_by_time``) or ``torchtitan`` (its default split of a
            decoder-only model; a :class:`PlanningError` for any other).
        optimizer: optimizer whose state is counted (``adam``, ``sgd``, ...) or state bytes
            per parameter byte.
        bandwidth: link bandwidth in bytes/s (or a rate such as ``10GB/s``) for devices
            without one (default: the profile's calibrated bandwidth, else free).
        data_parallel: replicas of the pipeline (D); each runs ``ceil(batch / D)`` samples
            and all-reduces its stages' gradients with the others once per step.
        batch: samples per step across all replicas (default: the profile's batch size).
        tensor_parallel: devices sharding each stage's layers (t, default 1): every stage
            is priced on one device of its t, its layers' figures those of
            :mod:`autopipe.planning.mesh.degree_figures` (sharded compute and memory divided
            by t, the tensor-parallel all-reduces exposed on the all-reduce bandwidth), as
            :func:`autopipe.search` prices ``Mesh(tensor=t)`` without a target's links;
            the plan's ``mesh`` records it. Needs a profile with shard counts (profiled
            with a tensor-parallel plan) whose heads t divide.
        allreduce_bandwidth: bytes/s of the gradient all-reduce (default: the profile's
            calibrated one, else ``bandwidth``; free when none is known).
        overhead: executor seconds per stage and micro-batch (default: calibrated, else 0).
        virtual_stages: stages per rank (v): ``devices`` then counts K·v stages, stage s
            on rank ``s % K``, run by an interleaved schedule (see
            :mod:`autopipe.planning.schedules.interleaving`). The ``optimal`` split then minimizes
            the interleaved step time by a local search from the exact K·v-stage split
            (:mod:`autopipe.planning.split.interleaved_balance`; exact only for v = 1), and each
            rank's stages together must fit its device (the capacity of its first stage).
        padded: every micro-batch runs at the size of the largest, ``ceil(batch / M)``
            rows (the distributed runner pads uneven ones), not their mean size.
        shard_optimizer: the D replicas shard each stage's optimizer state among them
            (ZeRO stage 1, DeepSpeed's stage 1 or Megatron-LM's distributed optimizer):
            a stage holds ``opt / D`` optimizer state bytes per parameter byte, not
            ``opt``; the step time is unchanged (reduce-scatter plus all-gather move what
            the all-reduce moves, see :mod:`autopipe.planning.model.cost_model`). No effect with
            ``data_parallel=1``.
        colocated: the stages run in one process (the single-process GPipe), so stages
            on devices of the same name share that device and take turns on it
            (:mod:`autopipe.planning.model.colocation`): the step is at least M times their
            summed cost, and with every stage on one device the ``optimal`` split is the
            one whose largest stage needs the least memory (every split takes the same
            time there). Default: every stage on a device of its own (ranks).

    Raises:
        PlanningError: no split fits, or the chosen strategy's split does not fit; the
            message names the stage or layer (or rank) and the bytes missing.
        ValueError: invalid arguments.
        TypeError: ``profile`` is not a :class:`Profile` (e.g. a path: load it with
            :meth:`Profile.load`), or another argument is of the wrong kind.
    """
    settings = with_overrides(settings, overrides, "plan", PLAN_FIELDS)
    profile = planned_profile(profile, settings)
    return plan_model(
        build_model(profile, devices, settings, uniform_mesh_lines), profile, settings
    )


def plan_model(model: CostModel, profile: Profile, settings: PipelineSettings) -> Plan:
    """The plan :func:`plan` makes of a cost model already built from ``profile`` under
    ``settings`` (:func:`autopipe.planning.model.plan_settings.build_model`), by
    ``settings.strategy``: several strategies price one cost model so.

    Raises:
        PlanningError: as :func:`plan`.
        ValueError: an unknown strategy.
    """
    result = _planned(model, profile, settings)
    result.recompute_norms = settings.recompute_norms
    result.recompute_up_proj = settings.recompute_up_proj
    return result


def _planned(model: CostModel, profile: Profile, settings: PipelineSettings) -> Plan:
    strategy = settings.strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if model.num_stages > model.num_layers:
        raise PlanningError(
            f"cannot split {model.num_layers} layers into {model.num_stages} non-empty stages; "
            f"use at most {model.num_layers} stages"
        )
    check_cuts(model)
    whole_modes = strategy == "optimal" and model.checkpoint == "auto" and model.virtual_stages > 1
    try:
        if strategy == "optimal" and _one_device(model):
            balance = memory_split(model)
        elif strategy == "optimal" and _replayed(model):
            balance = interleaved_balance(model)
        elif strategy == "optimal":
            balance = optimal_split(model)
        else:
            balance = _peer_balance(model, profile, strategy)
        result = describe(
            model, balance, profile, strategy, settings.optimizer, batch=settings.batch
        )
        _check_fits(model, result, strategy)
    except PlanningError:
        if not whole_modes:
            raise
        found = _whole_modes(model, profile, settings, None)
        if found is None:
            raise
        return found
    if whole_modes:
        return _whole_modes(model, profile, settings, result) or result
    return result


def _whole_modes(
    model: CostModel, profile: Profile, settings: PipelineSettings, chosen: Plan | None
) -> Plan | None:
    """``auto``'s plan (``chosen``; ``None`` where none fits), or that of a mode applied
    to every stage alike where it fits and is faster.

    With several stages per rank each stage chooses what to re-compute within its share
    of the device, blind to what its rank's other stages leave free: stages holding very
    different numbers of micro-batches (a V's 8 and 1) may re-compute where keeping
    everything fits the rank, or find no choice that fits where re-computing every stage
    does. So ``never`` and ``always`` are planned too (and ``except_last`` where the
    schedule runs it), and ``auto`` is never slower nor refused where one of them fits.
    """
    best = chosen
    # except_last has no meaning where the backward is split (the cost model refuses it).
    modes = [m for m in FIXED_CHECKPOINT_MODES if m != "except_last" or not model.split_backward]
    for mode in modes:
        options = (model.chunks, mode, model.schedule, model.optimizer, model.options)
        whole = CostModel(model.layers, model.devices, *options)
        try:
            balance = interleaved_balance(whole)
            result = describe(
                whole, balance, profile, "optimal", settings.optimizer, batch=settings.batch
            )
            _check_fits(whole, result, "optimal")
        except PlanningError:
            continue
        if best is None or result.step_time < best.step_time:
            result.checkpoint = "auto"  # the stages' own modes say which
            best = result
    return best


def _one_device(model: CostModel) -> bool:
    """Whether every stage takes turns on one shared device, so every split takes the
    same time."""
    return len(model.shared) == 1 and len(model.shared[0]) == model.num_stages


def _peer_balance(model: CostModel, profile: Profile, strategy: str) -> list[int]:
    """The split a peer's strategy picks, handed what the peer measures.

    ``parameters`` weighs each layer by its parameter bytes, as DeepSpeed weighs its
    parameter count (buffers are no parameters; with one dtype the split is the same).
    ``blockpartition`` balances each layer's forward plus backward time per micro-batch in
    whole microseconds, as torchgpipe's ``balance_by_time`` times a layer (no recomputation,
    no transfer) and truncates it. ``torchtitan`` reads the layers' names.

    Raises:
        PlanningError: the peer's split cuts between the users of a tensor that must stay
            on one stage (:mod:`autopipe.planning.model.cut_rules`).
    """
    times = model.layers.forward + model.layers.backward
    costs: list[float] = [int(t * _MICROSECONDS) for t in times.tolist()]
    names = [layer.name for layer in profile.layers]
    balance = baseline_balance(strategy, costs, model.num_stages, model.layers.params, names)
    # The peer's split as the peer makes it, or a refusal: never a split the runner refuses.
    crossed = crossing(balance, model.layers.tied)
    if crossed is not None:
        users = ", ".join(model.layers.names[k] for k in crossed.layers)
        raise PlanningError(
            f"the {strategy} split {balance} puts the users of {crossed.names[0]} ({users}) "
            "on different stages, but it is written in place during forward and must stay "
            "on one; plan with strategy optimal, which keeps them together"
        )
    return balance


# torchgpipe's profile_times sums ``int(seconds * 1_000_000)`` per layer and run.
_MICROSECONDS = 1_000_000


def _replayed(model: CostModel) -> bool:
    """Whether the model's step is its schedule's order replayed (virtual stages, zero
    bubble) rather than GPipe's formula."""
    return model.virtual_stages > 1 or model.schedule == "zb"  # (V schedules: v = 2)


def interleaved_balance(model: CostModel) -> list[int]:
    """The best split for virtual stages: a local search from the exact K·v-stage split
    and the uniform one (:mod:`autopipe.planning.split.interleaved_balance`)."""
    return timed_interleaved_balance(model)[0]


def timed_interleaved_balance(model: CostModel) -> tuple[list[int], float]:
    """:func:`interleaved_balance` and its split's replayed pipeline time
    (:func:`autopipe.planning.split.interleaved_balance.pipeline_time`)."""
    # A rank holds at least what each of its stages needs alone: where no K·v-stage split
    # fits stage by stage, no interleaved one fits either (the search meets thousands).
    where = f"{model.num_stages} stages, {model.virtual_stages} per device,"
    try:
        exact = optimal_split(model)
    except PlanningError as exc:  # names the stage and the bytes it lacks
        message = str(exc).replace(f"{model.num_stages} stages", where, 1)
        raise PlanningError(message) from None
    params = model.layers.params + model.layers.buffers
    uniform = baseline_balance("uniform", model.layer_time(), model.num_stages, params)
    balance = timed_split(model, [exact, uniform])
    if balance is None:
        r, over = _most_over_rank(model, exact)
        held = rank_stages(r, model.num_ranks, model.virtual_stages, model.schedule)
        raise PlanningError(
            f"no split into {where} fits memory: each stage of the best split {exact} fits "
            f"a device alone, but rank {r} holds stages {held}, which need "
            f"{format_bytes(over)} more than its {format_bytes(model.capacity(held[0]))} "
            "together; give the devices more memory, re-compute more (--checkpoint always), "
            "or use fewer virtual stages"
        )
    return balance


def _over(
    model: CostModel, balance: Sequence[int], memory: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """The bytes each stage and each rank (its stages together) is over its device under
    ``balance``, the stages' peaks being ``memory``."""
    saved = stage_saved(model, balance)[None, :]
    parts = stage_held(model, balance)[None]
    stage_over, rank_over = overflows(model, np.array([list(memory)]), saved, parts)
    return stage_over[0], rank_over[0]


def _most_over_rank(model: CostModel, balance: Sequence[int]) -> tuple[int, float]:
    """The rank whose stages together are the most over its device under ``balance``,
    and by how many bytes."""
    spans = stage_spans(balance)
    memory = [
        float(model.stage_memory(k, np.array(s), np.array(e))) for k, (s, e) in enumerate(spans)
    ]
    rank_over = _over(model, balance, memory)[1]
    r = int(np.argmax(rank_over))
    return r, float(rank_over[r])


def _check_fits(model: CostModel, result: Plan, strategy: str) -> None:
    """Refuses a split with a stage over its device (naming the one most over) or, with
    virtual stages, a rank whose stages together are over its device."""
    stage_over, rank_over = _over(model, result.balance, [s.memory for s in result.stages])
    if np.any(stage_over > 0):
        worst = result.stages[int(np.argmax(stage_over))]
        raise PlanningError(
            f"the {strategy} split {result.balance} does not fit: stage {worst.index} "
            f"(layers {worst.layers[0]}..{worst.layers[-1]}) needs "
            f"{format_bytes(float(stage_over[worst.index]))} more than its "
            f"{format_bytes(worst.capacity or 0)}"
        )
    over = np.flatnonzero(rank_over > 0)
    if len(over):
        r = int(over[0])
        held = rank_stages(r, len(rank_over), result.virtual_stages, result.schedule)
        capacity = result.stages[r].capacity or 0
        raise PlanningError(
            f"the {strategy} split {result.balance} does not fit: rank {r} holds stages "
            f"{held}, which need {format_bytes(float(rank_over[r]))} "
            f"more than its {format_bytes(capacity)}; use fewer virtual stages, more "
            "memory or checkpointing"
        )


def evaluate(
    profile: Profile,
    balance: Sequence[int],
    devices: int | Sequence[DeviceSpec | str] | None = None,
    *,
    strategy: str = "given",
    optimizer: str | float = "adam",
    **kwargs: Any,
) -> Plan:
    """Predicts the costs of a given balance without checking that it fits.

    Takes the same keyword arguments as :func:`plan`; ``devices`` defaults to
    ``len(balance)`` stages.
    """
    check_profile(profile, "evaluate")
    if not isinstance(balance, Sequence) or any(
        isinstance(b, bool) or not isinstance(b, int) for b in balance
    ):
        raise ValueError(f"balance must be a list of layer counts per stage, got {balance!r}")
    settings = PlanSettings(optimizer=optimizer, **kwargs)
    stages = len(balance) if devices is None else devices
    model = build_model(profile, stages, settings, uniform_mesh_lines)
    if len(balance) != model.num_stages:
        raise ValueError(f"balance has {len(balance)} stages but there are {model.num_stages}")
    if sum(balance) != model.num_layers or min(balance) < 1:
        raise ValueError(
            f"balance {list(balance)} must have entries >= 1 summing to {model.num_layers}"
        )
    return describe(model, list(balance), profile, strategy, optimizer, batch=settings.batch)


def describe(
    model: CostModel,
    balance: list[int],
    profile: Profile,
    strategy: str,
    optimizer: str | float,
    *,
    batch: int | None = None,
    record: dict[str, Any] | None = None,
) -> Plan:
    """Builds the :class:`Plan` record of ``balance`` under ``model``.

    Args:
        model: the cost model the balance was planned with.
        balance: layers per stage.
        profile: the profile behind the model.
        strategy: the name of the strategy that chose the balance.
        optimizer: the optimizer whose state the model counts.
        batch: samples per step across all replicas (default: the profile's batch size).
        record: ``profile.to_dict()`` when already at hand (it is costly for big models).
    """
    total_batch = profile.batch_size if batch is None else batch
    replica = math.ceil(total_batch / model.data_parallel)
    bounds = stage_bounds(balance)
    stages = []
    for k in range(model.num_stages):
        s, e = np.array(bounds[k]), np.array(bounds[k + 1])
        time, memory, _ = model.stage_costs(k, s, e)
        parts = model.stage_parts(k, s, e)
        transfer = float(model.transfer_time(k, e))
        state = float(model.state_memory(s, e))
        held = [bool(h) for h in model.holds_tied(s, e)]
        stages.append(
            StagePlan(
                index=k,
                device=model.devices[k].name,
                start=int(s),
                stop=int(e),
                layers=model.layers.names[int(s) : int(e)],
                compute=float(time) - transfer,
                transfer=transfer,
                time=float(time),
                memory=float(memory),
                param_memory=state,
                activation_memory=float(memory) - state,
                capacity=model.devices[k].memory,
                in_flight=model.in_flight(k),
                checkpoint=model.stage_checkpoint(k, int(s), int(e)),
                recompute_units=model.recompute_units(k, int(s), int(e)),
                recompute=float(model.recompute_time(k, s, e)),
                overhead=model.overhead,
                allreduce=float(model.allreduce_time(s, e)),
                update=float(model.update_time(s, e)),
                forward=float(parts.forward),
                weight=float(parts.backward * parts.weight),
                alltoall_forward=float(parts.comm_forward),
                alltoall_backward=float(parts.comm_backward),
                tied=float(sum(t.bytes for t, h in zip(model.tied, held, strict=True) if h)),
            )
        )
    times = np.array([stage.time for stage in stages])
    m, ranks = model.chunks, model.num_ranks
    # Interleaved and zero bubble: the schedule's order replayed (the closed formula holds
    # for balanced stages only).
    if _replayed(model):
        pipeline = pipeline_time(model, balance)
    elif model.shared:  # stages that take turns on one device
        pipeline = shared_step_time(list(times), m, model.shared)
        ranks = device_count(model.num_stages, model.shared)
    else:
        pipeline = gpipe_step_time(times, m)
    allreduce = max(stage.allreduce for stage in stages)
    # What follows each stage's last backward: its all-reduce and its optimizer's step;
    # the stages that take turns on one device run theirs one after another.
    after = max(
        [stage.allreduce + stage.update for stage in stages]
        + [sum(stages[k].allreduce + stages[k].update for k in group) for group in model.shared]
    )
    tied = _tied(model, balance)
    tied_time = sum(item.time for item in tied)
    extra = after - allreduce + model.layers.step_overhead
    total = pipeline + allreduce + tied_time + extra
    # Idle share of the devices over the pipeline; (K−1)/(M+K−1) for K devices when
    # stages are balanced, 0 for stages that all take turns on one.
    bubble = 1.0 - m * float(times.sum()) / (ranks * pipeline) if pipeline > 0 else 0.0
    plan = Plan(
        balance=list(balance),
        stages=stages,
        chunks=m,
        micro_batch=math.ceil(replica / m),
        checkpoint=model.checkpoint,
        schedule=model.schedule,
        strategy=strategy,
        optimizer=str(optimizer),
        bottleneck=float(times.max()),
        bottleneck_stage=int(np.argmax(times)),
        step_time=total,
        bubble=bubble,
        devices=list(model.devices),
        profile=profile.to_dict() if record is None else record,
        data_parallel=model.data_parallel,
        batch_size=total_batch,
        allreduce=allreduce,
        throughput=total_batch / total if total > 0 else 0.0,
        virtual_stages=model.virtual_stages,
        tied=tied,
        tied_time=tied_time,
        step_extra=extra,
        shard_optimizer=model.shard_optimizer and model.shard_over > 1,
        shared=[list(group) for group in model.shared],
        mesh=model.options.mesh,
        device_memory=_device_memory(model, balance, stages),
    )
    if model.overlapped and pipeline > 0:  # the pairs' hidden all-to-alls keep no rank busy
        busy = m * float(times.sum()) - sum(hidden_alltoalls(plan))
        plan.bubble = 1.0 - busy / (ranks * pipeline)
    return plan


def _device_memory(model: CostModel, balance: list[int], stages: list[StagePlan]) -> list[float]:
    """Each rank's peak bytes with virtual stages (its stages do not all peak at once,
    :func:`autopipe.planning.model.spans.rank_memory`); empty with one stage per rank."""
    if model.num_ranks == model.num_stages:
        return []
    memory = np.array([[stage.memory for stage in stages]])
    saved = stage_saved(model, balance)[None, :]
    held = stage_held(model, balance)[None]
    return [float(m) for m in rank_memory(model, memory, saved, held)[0]]


def _tied(model: CostModel, balance: list[int]) -> list[TiedPlan]:
    """Each tied tensor's copies under ``balance``: the stages holding one, and the time
    to sum their gradients."""
    bounds = stage_bounds(balance)
    starts, ends = np.array(bounds[:-1]), np.array(bounds[1:])
    held = model.holds_tied(starts, ends)
    times = model.tied_times(balance)
    return [
        TiedPlan(
            names=list(item.names),
            stages=[int(k) for k in np.flatnonzero(h)],
            bytes=int(item.bytes),
            time=time,
            buffer=item.buffer,
        )
        for item, h, time in zip(model.tied, held, times, strict=True)
    ]
