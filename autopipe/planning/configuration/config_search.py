"""``search``: the fastest pipeline × data-parallel configuration of N devices.

A configuration is K pipeline stages times D data-parallel replicas (``K·D <= N``), M
micro-batches per replica (one M per distinct micro-batch size ``ceil(b/M)`` of the replica
batch b), a checkpoint mode and a schedule. Its value is the least predicted step time
(pipeline plus gradient all-reduce) of any split that fits memory: the objective of
:func:`autopipe.planning.split.exact.optimal_split`, whose O(K·L·W) program is too slow to run on
each of thousands of configurations. A best-first branch and bound ranks them instead, each
configuration going through cheaper tiers first:

1. an O(1) bound from sums and maxima of the layer costs
   (``Σ + (M−1)·max(Σ/K, largest layer) + α·max(P/K, largest P)``) and a check that
   parameters, activations and the largest layer can fit at all;
2. the relaxed min-max partition of :mod:`autopipe.planning.split.screening` (greedy probes, O(K)
each,
   exact memory, smallest sends): a tighter bound and a split whose real step time is
   checked; when the two agree the configuration is solved (always, without transfer
   costs and with a fixed checkpoint mode);
3. the interval solver of :mod:`autopipe.planning.split.intervals` (O(K·L·log L) passes): exact
sends and
   per-stage checkpointing; exact unless checkpointed boundary inputs make the memory
   limits non-monotone, in which case it bounds;
4. the dynamic program of :mod:`autopipe.planning.split.exact`, for what is still unresolved.

With ``virtual_stages``, configurations of K·v interleaved stages (v > 1) are bounded by
a device's share of the work (``max(Σc, M·Σc/K)``) and then planned as :func:`autopipe.plan`
plans them (the replayed schedule, :mod:`autopipe.planning.split.interleaved_balance`).

A configuration is expanded only while its bound is below the ``top``-th best step time
found so far, so the returned ranking equals that of exhaustive :func:`autopipe.plan`
calls (ties may pick another balance of the same step time).

With ``shard_optimizer`` the replicas of each configuration shard its stages' optimizer
state (ZeRO-1); ``"auto"`` searches that way and returns each plan unsharded where that
loses nothing (:mod:`autopipe.planning.configuration.optimizer_sharding`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from autopipe import PlanningError
from autopipe.planning.configuration.mesh_choices import (
    MeshChoices,
    mesh_configurations,
    tensor_degrees,
)
from autopipe.planning.configuration.mesh_report import explain_meshes, fill_mesh_figures
from autopipe.planning.configuration.one_device_search import (
    check_one_device,
    one_device_search,
)
from autopipe.planning.configuration.optimizer_sharding import check_shard_optimizer, settle
from autopipe.planning.configuration.search_notes import (
    annotate,
    explain_infeasible,
    why_slower,
)
from autopipe.planning.configuration.search_space import Bounds, Config, Space, configurations
from autopipe.planning.mesh.mesh_links import MeshLinks
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.mesh import ZERO_STAGES, Mesh
from autopipe.planning.model.names import (
    CHECKPOINT_MODES,
    SCHEDULES,
    SEARCH_CHECKPOINTS,
    V_SCHEDULES,
)
from autopipe.planning.model.plan_settings import check_profile
from autopipe.planning.model.plans import Plan
from autopipe.planning.model.quantities import parse_bytes
from autopipe.planning.model.spans import split_fits, stage_bounds, stage_memory, stage_spans
from autopipe.planning.pipeline_settings import PipelineSettings, with_overrides
from autopipe.planning.planner import describe, timed_interleaved_balance
from autopipe.planning.recomputed_modules import planned_profile
from autopipe.planning.split.exact import solve_split, split_value
from autopipe.planning.split.intervals import IntervalSolver
from autopipe.planning.split.screening import Relaxation
from autopipe.planning.split.tolerances import SAME_TIME
from profiler import Profile

__all__ = ["SearchOptions", "search"]


@dataclass
class _Found:
    value: float
    balance: list[int]
    model: CostModel
    exact: bool


def _check(devices: int, top: int, schedules: Sequence[str], checkpoints: Sequence[str]) -> None:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    for what, given in (("schedules", schedules), ("checkpoints", checkpoints)):
        # A string is a sequence too: "gpipe" would be read as five schedules.
        if isinstance(given, str) or not isinstance(given, Sequence):
            hint = f"; pass [{given!r}]" if isinstance(given, str) else ""
            raise TypeError(f"{what} must be a list of names, got {given!r}{hint}")
    for schedule in schedules:
        if schedule == "zb":
            raise ValueError(
                "the search weighs gpipe and 1f1b; plan zero bubble with "
                "autopipe.plan(..., schedule='zb')"
            )
        if schedule not in (*SCHEDULES, *V_SCHEDULES):
            raise ValueError(
                f"unknown schedule {schedule!r}: choose {', '.join((*SCHEDULES, *V_SCHEDULES))}"
            )
    for mode in checkpoints:
        if mode not in CHECKPOINT_MODES:
            raise ValueError(
                f"unknown checkpoint mode {mode!r}: choose {', '.join(CHECKPOINT_MODES)}"
            )
    if not schedules or not checkpoints:
        raise ValueError("give at least one schedule and one checkpoint mode")


@dataclass(frozen=True)
class SearchOptions:
    """What :func:`search` weighs besides the settings; see there for each field."""

    schedules: Sequence[str] = SCHEDULES
    checkpoints: Sequence[str] = SEARCH_CHECKPOINTS
    top: int = 10
    max_chunks: int | None = None
    even: bool = False
    virtual_stages: Sequence[int] = (1,)
    shard_optimizer: bool | str = False
    one_device: bool = False
    tensor_parallel: Sequence[int] = (1,)
    context_parallel: Sequence[int] = (1,)
    sequence_parallel: Sequence[bool] = (False,)
    zero: Sequence[int] = ()
    micro_batch: int | None = None
    sequence: int = 0
    links: MeshLinks | None = None
    expert_parallel: Sequence[int] | None = None
    pipeline_parallel: Sequence[int] | None = None
    recompute_norms: Sequence[bool] | bool | None = None

    @property
    def meshed(self) -> bool:
        """Whether the search weighs a mesh (and so takes every device; see
        :mod:`autopipe.planning.configuration.mesh_choices`)."""
        return (
            tuple(self.tensor_parallel) != (1,)
            or tuple(self.context_parallel) != (1,)
            or bool(self.zero)
            or self.micro_batch is not None
            or tuple(self.sequence_parallel) != (False,)
            or bool(self.sequence)
            or (self.expert_parallel is not None and tuple(self.expert_parallel) != (1,))
        )


# The settings the search reads; the rest (chunks, checkpoint, schedule, ...) it searches.
SEARCH_SETTINGS = frozenset(
    {
        "memory",
        "batch",
        "optimizer",
        "bandwidth",
        "allreduce_bandwidth",
        "recompute_norms",
        "recompute_up_proj",
    }
)
_OPTIONS = frozenset(f.name for f in fields(SearchOptions))


def search(
    profile: Profile,
    devices: int = 8,
    settings: PipelineSettings | None = None,
    options: SearchOptions | None = None,
    **overrides: Any,
) -> list[Plan]:
    """Ranks the pipeline × data-parallel configurations of ``devices`` identical devices.

    The keywords below are laid over ``options`` (``schedules`` to ``shard_optimizer``)
    and ``settings`` (the others); any other keyword is refused (``TypeError``).

    Args:
        profile: per-layer measurements.
        devices: devices available (N); a configuration uses K stages × D replicas <= N.
        settings: the settings to read ``memory`` to ``allreduce_bandwidth`` from.
        options: the search's own options, :class:`SearchOptions`.
        memory: capacity of each device (bytes or ``16GiB``-style; default unlimited).
        batch: samples per step across all replicas (default: the profile's batch size).
        schedules: pipeline schedules to consider.
        checkpoints: checkpoint modes to consider (``never``, ``except_last``,
            ``always``, ``auto``).
        optimizer: optimizer whose state is counted, or state bytes per parameter byte.
        bandwidth: link bandwidth between stages in bytes/s (or a rate such as
            ``10GB/s``; default: the profile's calibrated bandwidth, else free).
        allreduce_bandwidth: bytes/s of the gradient all-reduce (default: the profile's
            calibrated one, else ``bandwidth``).
        top: how many configurations to return.
        max_chunks: the most micro-batches per replica (default ``max(32, 16·K)``).
        even: only configurations whose replicas and micro-batches split the batch into
            equal parts, as :class:`autopipe.distributed.DistributedPipeline` needs for
            models with BatchNorm (it pads the micro-batches of other models).
        virtual_stages: stages per device to consider (v): one stage per device is always
            searched, and each v > 1 listed adds K·v stages run by torch's interleaved
            schedules (1F1B: interleaved 1F1B; gpipe: looped BFS),
            without checkpointing, each valued by the replayed schedule
            (:mod:`autopipe.planning.split.interleaved_balance`) with the runner's calibrated
            ``virtual_overhead_s`` when there is one.
        shard_optimizer: ``True``: the D replicas of each configuration shard its stages'
            optimizer state (ZeRO stage 1, DeepSpeed's stage 1 or Megatron-LM's
            distributed optimizer; same step time, ``opt / D`` state bytes per parameter
            byte). ``"auto"``: search so, then return each plan unsharded where it fits
            unsharded as fast; a plan that stays sharded records it and notes why
            (unsharded it does not fit, or is slower). ``False`` (default): no sharding.
        one_device: every stage on the profile's one device, in one process, taking
            turns on it (:mod:`autopipe.planning.configuration.one_device_search`):
            ``devices`` is then the most stages, every configuration has one replica and
            runs GPipe's fill-drain (only ``gpipe`` of ``schedules`` is weighed), and its
            stages together must fit ``memory``. Virtual stages and a sharded optimizer
            state are refused (``ValueError``).
        tensor_parallel: tensor-parallel degrees t to weigh; empty: every degree up to
            one node's devices that the layers' heads divide. Any t > 1, c > 1, a ZeRO
            list or a micro-batch size makes the search a mesh search: each
            configuration takes all ``devices`` (``t·c·K·D = N``), see
            :mod:`autopipe.planning.configuration.mesh_choices` and
            :mod:`autopipe.planning.mesh.degree_figures`.
        context_parallel: context-parallel degrees c to weigh.
        sequence_parallel: sequence parallelism off and/or on (with t > 1).
        zero: ZeRO stages to weigh (0 to 3); empty: ``shard_optimizer`` decides (ZeRO-1
            or none).
        micro_batch: samples per micro-batch; M then follows: ``batch / (D · micro_batch)``.
        sequence: tokens per sample, for the tokens per second the plans report (0:
            unknown).
        links: the intra- and inter-node links the mesh's groups run on
            (:class:`autopipe.planning.mesh.mesh_links.MeshLinks`); default: every group
            on the all-reduce link and the stages on ``bandwidth``.
        expert_parallel: expert-parallel degrees e to weigh for a profile with routed
            experts; empty: every degree dividing ``D·c`` and every block's expert count
            (:mod:`autopipe.planning.mesh.expert_figures`). Given (other than ``(1,)``),
            it makes the search a mesh search; ``None`` (default): every such degree when
            other options make it one.
        pipeline_parallel: the pipeline depths K (ranks per pipeline) to weigh, e.g. a
            published run's; ``None`` (default): every depth the devices allow.
        recompute_norms: the norms' outputs kept (``False``) and/or re-computed (``True``)
            to weigh, one or a list, e.g. ``(False, True)``: each is searched and their
            plans ranked together (:mod:`autopipe.planning.recomputed_modules`); ``None``
            (default): as the settings' ``recompute_norms`` says.

    Returns:
        Up to ``top`` plans, fastest (highest throughput) first, each with its
        ``data_parallel``, ``throughput`` and ``notes`` (for all but the best, why it is
        slower than the best; for the best, what the search covered and which faster
        configurations do not fit).

    Raises:
        PlanningError: no configuration fits; the message gives the closest one.
        ValueError: invalid arguments.
    """
    check_profile(profile, "search")
    if options is not None and not isinstance(options, SearchOptions):
        raise TypeError(f"search() takes options=SearchOptions(...), got {type(options).__name__}")
    mine = {k: v for k, v in overrides.items() if k in _OPTIONS}
    opts = replace(options or SearchOptions(), **mine)
    rest = {k: v for k, v in overrides.items() if k not in _OPTIONS}
    accepted = SEARCH_SETTINGS | _OPTIONS
    chosen = with_overrides(settings, rest, "search", accepted)
    if opts.recompute_norms is not None:
        ways = _norm_ways(opts.recompute_norms)
        if len(ways) > 1:
            return _both_ways(profile, devices, chosen, opts, ways)
        chosen, opts = replace(chosen, recompute_norms=ways[0]), replace(opts, recompute_norms=None)
    profile = planned_profile(profile, chosen)
    schedules, checkpoints, top = opts.schedules, opts.checkpoints, opts.top
    max_chunks, even, virtual_stages = opts.max_chunks, opts.even, opts.virtual_stages
    memory, batch, optimizer = chosen.memory, chosen.batch, chosen.optimizer
    bandwidth, allreduce_bandwidth = chosen.bandwidth, chosen.allreduce_bandwidth
    _check(devices, top, schedules, checkpoints)
    total_batch = profile.batch_size if batch is None else batch
    if isinstance(total_batch, bool) or not isinstance(total_batch, int) or total_batch < 1:
        raise ValueError(f"batch must be a positive integer, got {total_batch!r}")
    if max_chunks is not None and (
        isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1
    ):
        raise ValueError(f"max_chunks must be a positive integer or None, got {max_chunks!r}")
    shard = check_shard_optimizer(opts.shard_optimizer)
    if memory is not None and not isinstance(memory, (int, float, str)):
        raise ValueError(f"the search takes one memory size for every device, got {memory!r}")
    capacity = None if memory is None else parse_bytes(memory)
    if isinstance(virtual_stages, int):
        raise TypeError(
            f"virtual_stages lists the stages per device to weigh, e.g. (1, {virtual_stages}), "
            f"got {virtual_stages!r}"
        )
    if not virtual_stages or any(
        isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in virtual_stages
    ):
        raise ValueError(f"virtual_stages must be positive integers, got {virtual_stages!r}")
    if opts.pipeline_parallel is not None and (
        isinstance(opts.pipeline_parallel, (int, str))
        or not opts.pipeline_parallel
        or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in opts.pipeline_parallel
        )
    ):
        raise ValueError(
            f"pipeline_parallel lists positive pipeline depths, got {opts.pipeline_parallel!r}"
        )
    if not isinstance(opts.one_device, bool):
        raise TypeError(f"one_device must be True or False, got {opts.one_device!r}")
    if opts.one_device:
        check_one_device(schedules, virtual_stages, shard)
    if opts.meshed and (opts.one_device or shard == "auto"):
        raise ValueError(
            "a mesh search (tensor or context parallelism, ZeRO stages, a micro-batch size) "
            "goes with neither one_device nor shard_optimizer='auto': list the ZeRO stages"
        )
    space = Space(
        profile,
        capacity=capacity,
        bandwidth=bandwidth,
        allreduce_bandwidth=allreduce_bandwidth,
        optimizer=optimizer,
        shard_optimizer=shard is not False,
        one_device=opts.one_device,
        links=opts.links,
    )
    if opts.one_device:
        found = one_device_search(
            profile,
            space,
            devices,
            total_batch,
            checkpoints,
            top=top,
            max_chunks=max_chunks,
            even=even,
            optimizer=optimizer,
        )
        return _flagged(found, chosen)
    bounds = Bounds(
        devices, len(profile), total_batch, checkpoints, schedules, max_chunks,
        tuple(virtual_stages),
    )  # fmt: skip
    if opts.meshed:
        configs = mesh_configurations(bounds, _mesh_choices(space, opts, shard is True))
        if not configs:
            raise ValueError(
                f"no mesh of {devices} devices matches the batch {total_batch}: t·c·K·D "
                "must be the devices, D · micro_batch divide the batch and an expert "
                "degree divide D·c; change the degrees, the batch or the micro-batch size"
            )
    else:
        configs = configurations(bounds, even, shard is not False)
    if opts.pipeline_parallel is not None:
        depths = set(opts.pipeline_parallel)
        configs = [c for c in configs if c.stages in depths]
        if not configs:
            raise ValueError(
                f"no configuration of {devices} devices has a pipeline of "
                f"{', '.join(map(str, sorted(depths)))} ranks: give depths dividing the "
                "devices over the other degrees"
            )
    ranking = _Ranking(space, top, checkpoints)
    ranking.run(configs)
    ranked = _rank(ranking.found, checkpoints, schedules)[:top]
    if not ranked:
        raise PlanningError(explain_infeasible(space, configs, devices))
    profile_dict = profile.to_dict()
    settled = [settle(space, c, f.model, f.balance, shard == "auto") for c, f in ranked]
    plans = [
        describe(
            s.model,
            s.balance,
            profile,
            "optimal",
            optimizer,
            batch=total_batch,
            record=profile_dict,
        )
        for s in settled
    ]
    if opts.meshed:
        fill_mesh_figures(plans, [c for c, _ in ranked], space, opts.sequence)
    ranking.infeasible.sort(key=lambda item: item[0])
    annotate(plans, space, ranking.infeasible, ranking.stats, devices)
    if opts.meshed:
        explain_meshes(plans, [c for c, _ in ranked], space)
    # On the best, and on a runner-up only where it shards otherwise than the best.
    for result, s in zip(plans, settled, strict=True):
        if s.note and (result is plans[0] or result.shard_optimizer != plans[0].shard_optimizer):
            result.notes.append(s.note)
    return _flagged(plans, chosen)


def _norm_ways(given: Sequence[bool] | bool) -> tuple[bool, ...]:
    """The ways of the norms to weigh: one (``True``/``False``) or a list of them."""
    if isinstance(given, bool):
        return (given,)
    if isinstance(given, str) or not given or any(not isinstance(w, bool) for w in given):
        raise ValueError(
            f"recompute_norms lists the ways to weigh, e.g. (False, True), got {given!r}"
        )
    return tuple(dict.fromkeys(given))


def _both_ways(
    profile: Profile,
    devices: int,
    settings: PipelineSettings,
    options: SearchOptions,
    ways: tuple[bool, ...],
) -> list[Plan]:
    """The plans of one search per way of the norms, ranked together: the best keeps its
    search's notes (and says both were weighed), every other one says why it is slower
    than that best (after what its mesh costs, where its search said so)."""
    plans: list[Plan] = []
    refusals: list[tuple[bool, Exception]] = []
    firsts: list[Plan] = []  # each way's best, whose notes were about its own search
    own: dict[int, Plan] = {}  # each plan's own search's best
    for way in ways:
        try:
            found = search(
                profile,
                devices,
                replace(settings, recompute_norms=way),
                replace(options, recompute_norms=(way,)),
            )
        except (PlanningError, ValueError) as exc:  # this way fits nothing, or no schedule
            refusals.append((way, exc))
            continue
        plans += found
        firsts.append(found[0])
        own.update((id(result), found[0]) for result in found)
    if not plans:
        raise refusals[0][1]
    plans.sort(key=lambda p: -p.throughput)
    plans = plans[: options.top]
    best = plans[0]
    for result in plans[1:]:
        if any(result is first for first in firsts):
            result.notes = [why_slower(result, best)]
        else:  # its own search's reason gives way to the one against the best of both
            before = why_slower(result, own[id(result)])
            others = [note for note in result.notes if note != before]
            result.notes = [*others, why_slower(result, best)]
    if refusals:
        for way, refusal in refusals:
            kept = "re-computed" if way else "kept"
            best.notes.append(f"with the norms' outputs {kept}: nothing planned ({refusal})")
    else:
        best.notes.append("weighed with the norms' outputs kept and re-computed")
    return plans


def _flagged(plans: list[Plan], settings: PipelineSettings) -> list[Plan]:
    """The plans, marked as planned with the norms and the up-projections re-computed
    where they were."""
    for result in plans:
        result.recompute_norms = settings.recompute_norms
        result.recompute_up_proj = settings.recompute_up_proj
    return plans


class _Ranking:
    """Best-first branch and bound over the configurations (see the module docstring)."""

    def __init__(self, space: Space, top: int, checkpoints: Sequence[str]) -> None:
        self.space, self.top, self.checkpoints = space, top, checkpoints
        self.found: dict[Config, _Found] = {}
        self.infeasible: list[tuple[float, Config]] = []
        self.stats = {
            "configurations": 0,
            "relaxed": 0,
            "intervals": 0,
            "exact": 0,
            "interleaved": 0,
        }
        self._relaxations: dict[Config, Relaxation] = {}
        self._replayed: set[Config] = set()

    def threshold(self, exclude: Config | None = None) -> float:
        """The ``top``-th best value known of configurations other than ``exclude``: one
        that cannot beat it is out."""
        others = (f.value for c, f in self.found.items() if c != exclude)
        values = heapq.nsmallest(self.top, others)
        return values[-1] if len(values) == self.top else math.inf

    def record(self, config: Config, result: _Found) -> None:
        if config.checkpoint == "auto" and result.exact:
            model = result.model
            spans = enumerate(stage_spans(result.balance))
            modes = {model.stage_checkpoint(k, s, e) for k, (s, e) in spans}
            if len(modes) == 1 and modes <= set(self.checkpoints):
                self.found.pop(config, None)
                return  # the same plan as the fixed mode's, which is searched too
        self.found[config] = result

    def run(self, configs: Sequence[Config]) -> None:
        self.stats["configurations"] = len(configs)
        queue: list[tuple[float, int, int, Config]] = []
        for i, config in enumerate(configs):
            bound, possible = self.space.bound(config)
            if possible:
                queue.append((bound, 1, i, config))
            else:
                self.infeasible.append((bound, config))
        heapq.heapify(queue)
        tiers = {1: self._relax, 2: self._intervals, 3: self._program}
        while queue:
            bound, tier, i, config = heapq.heappop(queue)
            limit = self.threshold(exclude=config)
            if bound >= limit * (1 - SAME_TIME):
                break
            if config.virtual > 1:
                self._interleaved(config, bound)
                continue
            lower = tiers[tier](config, bound, limit)
            if lower is not None:
                heapq.heappush(queue, (max(lower, bound), tier + 1, i, config))

    def _settle(
        self,
        config: Config,
        bound: float,
        limit: float,
        model: CostModel,
        found: tuple[float, list[int]] | None,
    ) -> float | None:
        """Records a tier's ``(lower bound, split)``; the bound to queue again with, if the
        configuration is not settled yet."""
        if found is None:
            self.infeasible.append((bound, config))
            self.found.pop(config, None)
            return None
        lower, balance = found
        if split_fits(model, balance):
            # Any split that fits is worth keeping: exact, or a bound from above.
            value = split_value(model, balance)
            exact = value <= lower * (1 + SAME_TIME)
            known = self.found.get(config)
            if known is None or exact or value < known.value:
                self.record(config, _Found(value, balance, model, exact))
            if exact:
                return None
        return lower if lower < limit * (1 - SAME_TIME) else None

    def _relax(self, config: Config, bound: float, limit: float) -> float | None:
        """Tier 2: the relaxed partition."""
        self.stats["relaxed"] += 1
        model = self.space.model(config)
        relaxation = Relaxation(model, self.space.memory_ends)
        lower = self._settle(config, bound, limit, model, relaxation.lower_bound(limit))
        if lower is not None:
            self._relaxations[config] = relaxation
        return lower

    def _intervals(self, config: Config, bound: float, limit: float) -> float | None:
        """Tier 3: the interval solver, exact when the memory limits are monotone."""
        self.stats["intervals"] += 1
        relaxation = self._relaxations[config]
        solver = IntervalSolver(relaxation, envelope=not relaxation.monotone)
        lower = self._settle(config, bound, limit, relaxation.model, solver.solve(limit))
        if lower is None:
            del self._relaxations[config]
        return lower

    def _interleaved(self, config: Config, bound: float) -> None:
        """Virtual stages: the planner's split of the replayed interleaved schedule.

        ``auto`` is weighed only where keeping every activation passes the memory bound
        but its best split does not fit (its ``never`` sibling, when searched, is
        evaluated first): there re-computing some units may make it fit, while a
        configuration whose activations are far over is not worth the replays (each costs
        far more than a plain split's solve).
        """
        if config in self._replayed:
            return
        self._replayed.add(config)
        if config.checkpoint == "auto" and "never" in self.checkpoints:
            sibling = replace(config, checkpoint="never")
            if not self.space.bound(sibling)[1]:
                self.infeasible.append((bound, config))
                return
            self._interleaved(sibling, bound)
            if sibling in self.found:
                return
        self.stats["interleaved"] += 1
        model = self.space.model(config)
        try:
            balance, value = timed_interleaved_balance(model)
        except PlanningError:
            self.infeasible.append((bound, config))
            return
        value += _allreduce(model, balance)
        value += model.tied_time(balance)
        self.record(config, _Found(value, balance, model, True))

    def _program(self, config: Config, bound: float, limit: float) -> None:
        """Tier 4: the dynamic program of :mod:`autopipe.planning.split.exact`."""
        self.stats["exact"] += 1
        model = self._relaxations.pop(config).model
        self._settle(config, bound, limit, model, solve_split(model, limit))


def _mesh_choices(space: Space, opts: SearchOptions, shard: bool) -> MeshChoices:
    """The degrees and stages a mesh search weighs, each checked against the profile.

    Raises:
        ValueError: a degree or stage that cannot be (the message says which and why).
    """
    per_node = opts.links.per_node if opts.links is not None else 0
    given = tuple(opts.tensor_parallel)
    table = space.table
    tensors = tensor_degrees(given, table.allowed_tensor, per_node)
    for what, degrees in (("tensor", tensors), ("context", tuple(opts.context_parallel))):
        if not degrees or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in degrees
        ):
            raise ValueError(f"{what} parallelism degrees must be integers >= 1, got {degrees!r}")
    for t in tensors:
        for c in opts.context_parallel:
            refused = table.refusal(Mesh(tensor=t, context=c))
            if refused:
                raise ValueError(refused)
    if True in tuple(opts.sequence_parallel) and max(tensors) == 1:
        raise ValueError(
            "sequence parallelism goes with a tensor-parallel degree above 1: add one "
            "(--tensor-parallel 2,4,8 or auto)"
        )
    zero = tuple(opts.zero) or ((1,) if shard else (0,))
    if any(z not in ZERO_STAGES or isinstance(z, bool) for z in zero):
        raise ValueError(f"zero stages must be among 0, 1, 2, 3, got {list(zero)!r}")
    micro = opts.micro_batch
    if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
        raise ValueError(f"micro_batch must be a positive integer, got {micro!r}")
    experts = table.experts.common if table.experts is not None else 0
    return MeshChoices(
        tensors,
        tuple(opts.context_parallel),
        tuple(opts.sequence_parallel),
        zero,
        micro,
        *_expert_choices(tuple(opts.expert_parallel or ()), experts),
    )


def _expert_choices(given: tuple[int, ...], experts: int) -> tuple[tuple[int, ...], int]:
    """The expert-parallel degrees to weigh (empty: every divisor of the blocks' expert
    count) and that count's greatest common divisor (0: no routed experts).

    Raises:
        ValueError: a degree that is no integer >= 1, or above 1 without routed experts.
    """
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in given):
        raise ValueError(f"expert parallelism degrees must be integers >= 1, got {given!r}")
    if not experts:
        if any(e > 1 for e in given):
            raise ValueError(
                "expert parallelism needs a profile whose layers have routed experts "
                "(profile a mixture-of-experts model); leave out the expert degrees"
            )
        return (1,), 0
    if not given:
        given = tuple(e for e in range(1, experts + 1) if experts % e == 0)
    return given, experts


def _allreduce(model: CostModel, balance: list[int]) -> float:
    """The step's gradient all-reduce: the slowest stage's, as the plan charges it."""
    bounds = stage_bounds(balance)
    return max(float(model.allreduce_time(bounds[k], bounds[k + 1])) for k in range(len(balance)))


def _rank(
    found: dict[Config, _Found], checkpoints: Sequence[str], schedules: Sequence[str]
) -> list[tuple[Config, _Found]]:
    """Exact results, fastest first; ties go to fewer devices, then to less memory."""

    def key(item: tuple[Config, _Found]) -> tuple[float, ...]:
        config, result = item
        return (
            result.value,
            config.devices,
            _peak_memory(result),
            checkpoints.index(config.checkpoint),
            schedules.index(config.schedule),
            config.virtual,
            config.chunks,
        )

    return sorted(((c, f) for c, f in found.items() if f.exact), key=key)


def _peak_memory(result: _Found) -> float:
    return float(stage_memory(result.model, result.balance).max())
