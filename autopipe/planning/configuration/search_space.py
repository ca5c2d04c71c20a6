"""The search space of :func:`autopipe.search`: configurations and their cheap bounds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.mesh.degree_figures import GroupLinks, MeshLines, mesh_lines
from autopipe.planning.mesh.mesh_links import GroupLink, MeshLinks, expert_nodes, group_link
from autopipe.planning.mesh.shard_table import ShardTable
from autopipe.planning.model.cost_model import CostModel, CostOptions, state_factor, sync_factor
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import LayerCosts, ProfileLines, optimizer_factor
from autopipe.planning.model.mesh import Mesh
from autopipe.planning.model.runner_figures import RunnerFigures
from autopipe.planning.schedules.interleaving import stage_rank
from autopipe.planning.split.screening import MemoryCache
from profiler import Profile

__all__ = []

Array = NDArray[np.float64]


@dataclass(frozen=True)
class Config:
    """One point of the search space.

    ``tensor``, ``context``, ``sequence_parallel`` and ``expert`` are the stage's mesh
    (:class:`autopipe.planning.model.mesh.Mesh`); ``zero`` its ZeRO stage, ``-1`` for the
    space's ``shard_optimizer`` (ZeRO-1 when set, else none).
    """

    stages: int
    replicas: int
    chunks: int
    micro_batch: int
    checkpoint: str
    schedule: str
    samples: int = 0  # per replica; 0: ``chunks · micro_batch``
    virtual: int = 1  # stages per device (v): K·v stages, run interleaved
    tensor: int = 1
    context: int = 1
    sequence_parallel: bool = False
    zero: int = -1
    expert: int = 1

    @property
    def devices(self) -> int:
        """Devices the configuration occupies: ``t·c·K·D``."""
        return self.tensor * self.context * self.stages * self.replicas

    @property
    def alone(self) -> bool:
        """Whether the configuration occupies a single device."""
        return self.devices == 1

    @property
    def mean_batch(self) -> float:
        """Mean micro-batch size: what times are predicted at."""
        return self.samples / self.chunks if self.samples else float(self.micro_batch)

    def label(self) -> str:
        virtual = f" v={self.virtual}" if self.virtual > 1 else ""
        mesh = ""
        if self.tensor > 1 or self.context > 1 or self.zero >= 0:
            sp = " SP" if self.sequence_parallel else ""
            ep = f" EP={self.expert}" if self.expert > 1 else ""
            zero = f" ZeRO-{self.zero}" if self.zero >= 0 else ""
            mesh = f"TP={self.tensor}{sp} CP={self.context}{ep}{zero} "
        return (
            f"{mesh}K={self.stages}{virtual} D={self.replicas} M={self.chunks} "
            f"{self.checkpoint} {self.schedule}"
        )


def chunk_options(batch: int, limit: int) -> list[tuple[int, int]]:
    """``(M, micro-batch size)`` for every distinct size ``ceil(batch/M)``, ``M <= limit``.

    M is the number of micro-batches that size really yields, e.g. ``batch=10`` gives
    ``(1, 10), (2, 5), (3, 4), (4, 3), (5, 2), (10, 1)``.
    """
    out, m = [], 1
    while m <= min(limit, batch):
        micro = -(-batch // m)
        chunks = -(-batch // micro)
        if chunks <= limit:
            out.append((chunks, micro))
        if micro == 1:
            break
        m = -(-batch // (micro - 1))
    return out


@dataclass(frozen=True)
class _Basis:
    """One view's figures at one micro-batch size, for bounds and models."""

    costs: LayerCosts
    boundary: float
    saved: float
    params: Array
    buffers: Array
    # The least a micro-batch keeps re-computing units (``auto``): each unit's kept bytes
    # or its input, the smaller; and the fewest seconds re-computing frees a byte for.
    least: float = 0.0
    ratio: float = math.inf


class Space:
    """Shared figures for building and bounding configurations.

    With ``shard_optimizer`` every configuration's replicas shard its stages' optimizer
    state (ZeRO-1: ``opt / D`` state bytes per parameter byte, see
    :mod:`autopipe.planning.model.cost_model`), and the bounds count that share. With
    ``one_device`` every stage is on the profile's one device, in one process, and the
    cost models price their turns on it (``colocated``). A configuration with a mesh
    (``t``, ``c``, ZeRO-2/3) is valued on one device's figures of it
    (:mod:`autopipe.planning.mesh.degree_figures`), its groups on ``links`` when given
    (else every group on the runner's all-reduce link, and its stages on the runner's).
    """

    def __init__(
        self,
        profile: Profile,
        *,
        capacity: int | None,
        bandwidth: float | str | None,
        allreduce_bandwidth: float | str | None,
        optimizer: str | float,
        shard_optimizer: bool = False,
        one_device: bool = False,
        links: MeshLinks | None = None,
    ) -> None:
        self.profile = profile
        self.shard_optimizer = shard_optimizer
        self.one_device = one_device
        self.lines = ProfileLines.from_profile(profile)
        self.lines_alone = ProfileLines.from_profile(profile, alone=True)
        # The figures :func:`autopipe.plan` builds its model with, for the same arguments.
        self.runner = RunnerFigures.resolve(
            profile, bandwidth=bandwidth, allreduce_bandwidth=allreduce_bandwidth
        )
        self.overhead = self.runner.overhead
        # Torch runs virtual stages on another runtime, with its own cost per operation.
        self.virtual_overhead = self.runner.replayed_overhead
        self.bandwidth = self.runner.bandwidth
        self.latency = self.runner.latency
        self.allreduce = self.runner.allreduce_bandwidth
        self.capacity = capacity
        self.optimizer = optimizer_factor(optimizer)
        self.links = links
        self._table: ShardTable | None = None
        self._views: dict[tuple[object, ...], MeshLines] = {}
        self._basis: dict[tuple[object, ...], _Basis] = {}
        self._compute: dict[tuple[object, ...], tuple[float, float]] = {}
        self.memory_ends: MemoryCache = {}

    @property
    def table(self) -> ShardTable:
        """The profile's counts and shard counts (gathered on first use)."""
        if self._table is None:
            self._table = ShardTable.from_profile(self.profile)
        return self._table

    def zero(self, config: Config, shard: bool | None = None) -> int:
        """The configuration's ZeRO stage (``shard`` overrides the space's ZeRO-1)."""
        if config.zero >= 0:
            return config.zero
        sharded = self.shard_optimizer if shard is None else shard
        return 1 if sharded else 0

    def mesh(self, config: Config, shard: bool | None = None) -> Mesh:
        """The configuration's mesh."""
        per_node = self.links.per_node if self.links is not None else 0
        zero = self.zero(config, shard) if config.zero >= 0 else 0
        return Mesh(
            config.tensor,
            config.context,
            config.sequence_parallel,
            zero,
            per_node,
            expert=config.expert,
        )

    def group_links(self, config: Config) -> tuple[GroupLinks, GroupLink]:
        """The links of the configuration's tensor, context and data-parallel groups, and
        of its pipeline (between stages)."""
        if self.links is None:
            ring = GroupLinks.uniform(GroupLink(self.allreduce))
            return ring, GroupLink(self.bandwidth, self.latency)
        mesh, k, d = self.mesh(config), config.stages, config.replicas
        groups = GroupLinks(
            group_link(self.links, mesh, k, d, "tp"),
            group_link(self.links, mesh, k, d, "cp"),
            group_link(self.links, mesh, k, d, "dp"),
            group_link(self.links, mesh, k, d, "ep") if config.expert > 1 else None,
            expert_nodes(self.links, mesh, k, d),
            self.links.intra if self.links.per_node else None,
        )
        return groups, group_link(self.links, mesh, k, d, "pp")

    def _view(self, config: Config) -> tuple[object, ...] | None:
        """What of the configuration changes its layers' figures (``None``: nothing)."""
        zero = self.zero(config)
        exchanges = zero >= 2 and config.replicas * config.context > 1
        if config.tensor == 1 and config.context == 1 and not exchanges and config.expert == 1:
            return None
        groups, _ = self.group_links(config)
        # The experts' exchanges run over t·D·c/e devices: D matters with experts.
        d = config.replicas if exchanges or self.table.experts is not None else 0
        return (
            config.tensor,
            config.context,
            config.sequence_parallel,
            zero,
            d,
            groups,
            config.expert,
        )

    def lines_of(self, config: Config) -> ProfileLines | MeshLines:
        """The lines one device of the configuration sees."""
        view = self._view(config)
        if view is None:
            return self.lines_alone if config.alone else self.lines
        if view not in self._views:
            groups, _ = self.group_links(config)
            mesh = replace(self.mesh(config), zero=self.zero(config))
            self._views[view] = mesh_lines(self.lines, self.table, mesh, groups, config.replicas)
        return self._views[view]

    def basis(self, config: Config) -> _Basis:
        """The configuration's layer costs at its micro-batch size, smallest boundary,
        total saved activations and (tied tensors once) parameters and buffers."""
        key = (config.micro_batch, config.mean_batch, config.alone, self._view(config))
        if key not in self._basis:
            lines = self.lines_of(config)
            costs = lines.at(config.micro_batch, time_batch=config.mean_batch)
            boundary = float(costs.output[:-1].min()) if len(costs) > 1 else 0.0
            # Shared bytes count once (more when a cut separates them: a lower bound).
            kept = costs.saved - costs.shared_bytes
            saved = float(kept.sum())
            inputs = np.concatenate([[costs.input], costs.output[:-1]])
            least = float(np.minimum(kept, inputs).sum())
            gain = kept - inputs
            ratio = (
                float((costs.forward[gain > 0] / gain[gain > 0]).min())
                if (gain > 0).any()
                else math.inf
            )
            params, buffers = costs.first_use()
            self._basis[key] = _Basis(costs, boundary, saved, params, buffers, least, ratio)
        return self._basis[key]

    def devices(self, stages: int, link: GroupLink | None = None) -> list[DeviceSpec]:
        cuda = self.profile.device.startswith("cuda") and not self.one_device
        names = [f"cuda:{k}" if cuda else self.profile.device for k in range(stages)]
        bandwidth = self.bandwidth if link is None else link.bandwidth
        latency = self.latency if link is None else link.latency
        return [DeviceSpec(name, self.capacity, 1.0, bandwidth, latency) for name in names]

    def state_factor(self, config: Config) -> float:
        """Bytes a device holds per parameter byte of its stage: weight, gradient and
        optimizer state, as the configuration's ZeRO stage shards them."""
        return state_factor(self.optimizer, self.zero(config), config.replicas * config.context)

    def state(self, config: Config, basis: _Basis) -> Array:
        """Each layer's state bytes on a device (tied tensors at their first user): the
        parameters' and, with routed experts, theirs at the experts' own sharding."""
        state = basis.params * self.state_factor(config) + basis.buffers
        experts = basis.costs.experts
        if experts is None:
            return state
        shard_over = self.mesh(config).expert_replicas(config.replicas)
        own = state_factor(self.optimizer, self.zero(config), shard_over)
        return state + experts * (own - self.state_factor(config))

    def sync_bandwidth(self, config: Config) -> float | None:
        """Bytes/s of the configuration's data-parallel exchanges."""
        return self.group_links(config)[0].data.bandwidth if self.links else self.allreduce

    def model(self, config: Config, shard: bool | None = None) -> CostModel:
        """The configuration's cost model; ``shard`` overrides the space's sharding."""
        v = config.virtual
        groups, pipe = self.group_links(config)
        devices = self.devices(config.stages, pipe if self.links else None)
        runner = self.runner
        if self.links is not None:
            runner = replace(runner, allreduce_bandwidth=groups.data.bandwidth)
        return runner.cost_model(
            self.basis(config).costs,
            # Each stage on its rank's device (k mod K, or the V placement's rank).
            [
                devices[stage_rank(k, config.stages, config.schedule)]
                for k in range(config.stages * v)
            ],
            config.chunks,
            config.checkpoint,
            config.schedule,
            self.optimizer,
            CostOptions(
                data_parallel=config.replicas,
                virtual_stages=v,
                # A configuration without a ZeRO stage of its own: the space's ZeRO-1.
                shard_optimizer=config.zero < 0 and self.zero(config, shard) == 1,
                colocated=self.one_device,
                mesh=self.mesh(config, shard),
            ),
        )

    def single(self, config: Config) -> float:
        """The least memory of the configuration's largest layer alone on a stage."""
        basis = self.basis(config)
        state = self.state(config, basis)
        return float(np.max(state + basis.costs.saved + basis.costs.peak))

    def compute(self, config: Config, r: float) -> tuple[float, float]:
        """Total (with ZeRO-2/3's least exposed exchanges) and largest per-layer compute
        with a re-computed share ``r``."""
        key = (config.micro_batch, config.mean_batch, config.alone, self._view(config), r)
        if key not in self._compute:
            costs = self.basis(config).costs
            layer = costs.forward * (1 + r) + costs.backward
            total = float(layer.sum())
            if costs.exposure is not None:
                # Cutting the model only exposes more of ZeRO-2/3's exchanges (a stage's
                # first ones are whole where one stage would hide them): the whole model's
                # exposure bounds the stages' sum.
                forward, backward = costs.exposure.exposed(0, len(costs))
                total += float(forward) * (1 + r) + float(backward)
            self._compute[key] = (total, float(layer.max()))
        return self._compute[key]

    def _sync(self, config: Config, stages: int) -> float:
        """A lower bound on the exchange after the drain: the largest stage's share."""
        basis = self.basis(config)
        alpha = sync_factor(
            self.zero(config), config.replicas * config.context, self.sync_bandwidth(config)
        )
        return alpha * max(float(basis.params.sum()) / stages, float(basis.params.max()))

    def bound(self, config: Config) -> tuple[float, bool]:
        """Tier 1: a lower bound on the configuration's value, and whether it may fit."""
        if config.virtual > 1:
            return self._virtual_bound(config)
        basis = self.basis(config)
        costs, boundary, saved = basis.costs, basis.boundary, basis.saved
        _, pipe = self.group_links(config)
        k, m = config.stages, config.chunks
        fastest = "never" if config.checkpoint == "auto" else config.checkpoint
        r = {"always": 1.0, "except_last": (m - 1) / m, "never": 0.0}[fastest]
        work, largest = self.compute(config, r)
        send = boundary / pipe.bandwidth if pipe.bandwidth and k > 1 else 0.0
        total = work + k * self.overhead + (k - 1) * (send + pipe.latency)
        bottleneck = max(total / k, largest + self.overhead)
        value = total + (m - 1) * bottleneck + self._sync(config, k)
        if self.capacity is None:
            return value, True
        # Summed over stages: state, kept activations, kept boundary inputs, one peak.
        keep = m if config.checkpoint == "never" and config.schedule == "gpipe" else 1
        ck = {"always": m, "except_last": m - 1}.get(config.checkpoint, 0)
        if config.schedule == "1f1b":
            ck = min(ck, 1)
        inputs = ck * (costs.input + (k - 1) * boundary)
        state = float(self.state(config, basis).sum())
        if config.checkpoint == "auto":  # re-computed units keep their inputs alone
            saved = basis.least
        need = state + keep * saved + inputs + float(costs.peak.max())
        return value, self.single(config) <= self.capacity and need <= k * self.capacity

    def _virtual_bound(self, config: Config) -> tuple[float, bool]:
        """Tier 1 for K·v interleaved stages: a device works ``M·C_r`` per step, at least
        the mean ``M·Σc / K``, and one micro-batch passes every stage in turn (``Σc``);
        the looped schedules add part of their bubble (:func:`_looped_step`)."""
        basis = self.basis(config)
        _, pipe = self.group_links(config)
        k, stages = config.stages, config.stages * config.virtual
        work = self.compute(config, 0.0)[0]
        costs = basis.costs
        if config.schedule == "dualpipev" and costs.alltoall_forward is not None:
            # Its overlapped pairs may hide every all-to-all: compute alone bounds them.
            assert costs.alltoall_backward is not None
            work -= float(costs.alltoall_forward.sum() + costs.alltoall_backward.sum())
        send = basis.boundary / pipe.bandwidth if pipe.bandwidth else 0.0
        total = work + stages * self.virtual_overhead + (stages - 1) * (send + pipe.latency)
        if self.capacity is None:
            return _looped_step(config, total) + self._sync(config, stages), True
        # Summed over the ranks: the state, one micro-batch's activations, one peak.
        state = float(self.state(config, basis).sum())
        peak = float(basis.costs.peak.max())
        need = state + basis.saved + peak
        if config.checkpoint == "always":  # what a rank keeps then is left unbounded
            need = state + peak
        if config.checkpoint == "auto":
            # What keeping everything is over must be freed by re-computing units, at
            # least at the cheapest seconds per byte any unit frees one for.
            deficit = max(need - k * self.capacity, 0.0)
            total += deficit * basis.ratio if deficit > 0 else 0.0
            need = state + basis.least + peak
        value = _looped_step(config, total) + self._sync(config, stages)
        return value, self.single(config) <= self.capacity and need <= k * self.capacity


# The looped schedules (stage s on rank s mod K) whose bubble the virtual-stage bound
# counts; zero bubble fills its bubble with deferred weight gradients and the V schedules
# fold their stages otherwise: they keep the plain bound.
LOOPED = ("gpipe", "1f1b")
# The share of the balanced looped schedule's bubble, (K - 1)·Σc / (K·v), that the bound
# counts. A pruning rule, not a proof: the replayed step of random stage times (lognormal,
# sparse, near-even; forward, backward and sends apart) stays above the work plus 0.69 of
# that bubble (tests/planning/configuration/test_search_space.py); stages whose forward
# and backward differ in ratio overlap part of the warm-up with the cool-down.
BUBBLE_SHARE = 0.5


def _looped_step(config: Config, total: float) -> float:
    """A lower bound on the step of ``config``'s K·v stages of ``total`` seconds per
    micro-batch: the mean device's work plus :data:`BUBBLE_SHARE` of the bubble under a
    looped schedule, and never below one micro-batch's pass (``total``)."""
    k, m, v = config.stages, config.chunks, config.virtual
    work = m * total / k
    if config.schedule in LOOPED:
        work += BUBBLE_SHARE * (k - 1) * total / (k * v)
    return max(total, work)


@dataclass(frozen=True)
class Bounds:
    """What bounds every configuration of a search, plain or mesh.

    Attributes:
        devices: the devices a configuration may take (N).
        layers: the profile's layers (at most one stage each).
        batch: samples per step across every replica.
        checkpoints: the checkpoint modes to weigh.
        schedules: the schedules to weigh.
        max_chunks: the most micro-batches per replica (``None``: ``max(32, 16·K)``).
        virtual_stages: the stages per device to weigh besides 1.
    """

    devices: int
    layers: int
    batch: int
    checkpoints: Sequence[str]
    schedules: Sequence[str]
    max_chunks: int | None = None
    virtual_stages: Sequence[int] = (1,)

    def chunks(self, replica: int, stages: int) -> list[tuple[int, int]]:
        """The ``(M, micro_batch)`` options of ``replica`` samples on ``stages`` stages."""
        return chunk_options(replica, self.max_chunks or max(32, 16 * stages))


def configurations(
    bounds: Bounds, even: bool = False, shard_optimizer: bool = False
) -> list[Config]:
    """Every configuration of at most ``bounds.devices`` devices (see :func:`autopipe.search`).

    Replica counts that leave each replica as many samples as one replica fewer does are
    left out: they only add all-reduce work (unless the replicas shard the optimizer state,
    whose share per device more replicas make smaller). With ``even``, only replica and
    micro-batch counts that divide the batch exactly. Each point's schedules, modes and
    virtual stages are :func:`variants`.
    """
    batch, out = bounds.batch, []
    for k in range(1, min(bounds.devices, bounds.layers) + 1):
        for d in range(1, min(bounds.devices // k, batch) + 1):
            replica = -(-batch // d)
            if d > 1 and replica == -(-batch // (d - 1)) and not shard_optimizer:
                continue
            if even and batch % d:
                continue
            for m, micro in bounds.chunks(replica, k):
                if even and m * micro != replica:
                    continue
                out.extend(variants(Config(k, d, m, micro, "never", "gpipe", replica), bounds))
    return out


# The modes the V schedules run: they split the backward, where except_last means nothing
# (a re-computed micro-batch keeps its reduced set until its input gradient, see
# autopipe.planning.schedules.split_holding).
V_CHECKPOINTS = ("never", "always", "auto")


def variants(point: Config, bounds: Bounds) -> list[Config]:
    """The schedule, checkpointing and virtual-stage variants of one point (its K, D, M).

    Virtual stages (v > 1) go with K >= 2, K·v layers at most, ``never`` or ``auto``
    checkpointing (``auto`` re-computes a stage, or units of it, only where it would not
    fit otherwise) and, for 1F1B, M a multiple of
    its rounds' micro-batches. The V schedules (``zbv``, ``dualpipev``, weighed only when
    listed) give 2K stages per variant (:func:`v_shaped`), ``never``, ``always`` or
    ``auto`` (which weighs ``always`` and re-computed units per stage).
    """
    k, m, layers, checkpoints = point.stages, point.chunks, bounds.layers, bounds.checkpoints
    out = []
    for schedule in bounds.schedules:
        if schedule in ("zbv", "dualpipev"):  # 2 stages per rank in a V
            if v_shaped(k, m, layers, schedule, checkpoints):
                for mode in V_CHECKPOINTS:
                    # ``auto`` weighs ``always`` per stage too: listing both adds nothing.
                    if mode in checkpoints and not (mode == "always" and "auto" in checkpoints):
                        out.append(replace(point, checkpoint=mode, schedule=schedule, virtual=2))
            continue
        if schedule == "1f1b" and m == 1 and "gpipe" in bounds.schedules:
            continue  # one micro-batch: 1F1B is GPipe
        for mode in checkpoints:
            if not redundant(mode, m, checkpoints):
                out.append(replace(point, checkpoint=mode, schedule=schedule))
        for v in bounds.virtual_stages:
            if interleaves(k, v, m, layers, schedule, checkpoints):
                # Virtual stages keep every activation, unless ``auto`` finds a stage
                # (or units of it) that must re-compute to fit.
                for mode in ("never", "auto"):
                    if mode in checkpoints:
                        out.append(replace(point, checkpoint=mode, schedule=schedule, virtual=v))
    return out


def interleaves(
    stages: int, virtual: int, chunks: int, layers: int, schedule: str, checkpoints: Sequence[str]
) -> bool:
    """Whether ``virtual`` stages per device make a configuration of their own."""
    if virtual < 2 or stages < 2 or stages * virtual > layers:
        return False
    if "never" not in checkpoints and "auto" not in checkpoints:
        return False
    per_round = chunks // max(1, chunks // stages)  # interleaved 1F1B's rounds
    return schedule == "gpipe" or chunks % per_round == 0


def v_shaped(
    ranks: int, chunks: int, layers: int, schedule: str, checkpoints: Sequence[str]
) -> bool:
    """Whether a V schedule (2K stages; ``never``, ``always`` or ``auto`` checkpointing)
    makes a configuration of ``ranks`` ranks: K >= 2, 2K layers at least, and for
    ``dualpipev`` 2K micro-batches."""
    if ranks < 2 or 2 * ranks > layers or not set(V_CHECKPOINTS) & set(checkpoints):
        return False
    return schedule == "zbv" or chunks >= 2 * ranks


def redundant(mode: str, chunks: int, checkpoints: Sequence[str]) -> bool:
    """Whether a mode cannot beat another mode that is searched too.

    With one micro-batch ``except_last`` is ``never`` (``auto`` is not: it may re-compute
    units); ``always`` never beats ``except_last``, which re-computes less and keeps no
    more (``keep`` is 1 for both and ``except_last`` keeps at most as many boundary inputs).
    """
    if chunks == 1 and mode == "except_last":
        return "never" in checkpoints
    return mode == "always" and "except_last" in checkpoints
