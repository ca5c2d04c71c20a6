"""The search space of :func:`autopipe.search`: configurations and their cheap bounds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import LayerCosts, ProfileLines, optimizer_factor
from autopipe.planning.model.runner_figures import RunnerFigures
from autopipe.planning.split.screening import MemoryCache
from profiler import Profile

__all__ = []


@dataclass(frozen=True)
class Config:
    """One point of the search space."""

    stages: int
    replicas: int
    chunks: int
    micro_batch: int
    checkpoint: str
    schedule: str
    samples: int = 0  # per replica; 0: ``chunks · micro_batch``
    virtual: int = 1  # stages per device (v): K·v stages, run interleaved

    @property
    def alone(self) -> bool:
        """Whether the configuration occupies a single device."""
        return self.stages * self.replicas == 1

    @property
    def mean_batch(self) -> float:
        """Mean micro-batch size: what times are predicted at."""
        return self.samples / self.chunks if self.samples else float(self.micro_batch)

    def label(self) -> str:
        virtual = f" v={self.virtual}" if self.virtual > 1 else ""
        return (
            f"K={self.stages}{virtual} D={self.replicas} M={self.chunks} {self.checkpoint} "
            f"{self.schedule}"
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


class Space:
    """Shared figures for building and bounding configurations.

    With ``shard_optimizer`` every configuration's replicas shard its stages' optimizer
    state (ZeRO-1: ``opt / D`` state bytes per parameter byte, see
    :mod:`autopipe.planning.model.cost_model`), and the bounds count that share. With
    ``one_device`` every stage is on the profile's one device, in one process, and the
    cost models price their turns on it (``colocated``).
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
        # Tied tensors once (at their first user): sums and maxima from below.
        self.params, self.buffers = self.lines.at(1.0).first_use()
        self._at: dict[tuple[int, float, bool], tuple[LayerCosts, float, float]] = {}
        self._single: dict[tuple[int, float, bool, float], float] = {}
        self._state: dict[float, float] = {}
        self._compute: dict[tuple[int, float, bool, float], tuple[float, float]] = {}
        self.memory_ends: MemoryCache = {}

    def devices(self, stages: int) -> list[DeviceSpec]:
        cuda = self.profile.device.startswith("cuda") and not self.one_device
        names = [f"cuda:{k}" if cuda else self.profile.device for k in range(stages)]
        return [
            DeviceSpec(name, self.capacity, 1.0, self.bandwidth, self.latency) for name in names
        ]

    def state_factor(self, replicas: int, shard: bool | None = None) -> float:
        """Bytes a stage holds per parameter byte with ``replicas`` copies: weight,
        gradient and optimizer state (a 1/D share of it when sharded)."""
        sharded = self.shard_optimizer if shard is None else shard
        return 2.0 + (self.optimizer / replicas if sharded else self.optimizer)

    def state(self, replicas: int) -> float:
        """All layers' parameters, gradients, optimizer state and buffers with
        ``replicas`` copies (tied tensors once, at their first user)."""
        factor = self.state_factor(replicas)
        if factor not in self._state:
            self._state[factor] = float((self.params * factor + self.buffers).sum())
        return self._state[factor]

    def model(self, config: Config, shard: bool | None = None) -> CostModel:
        """The configuration's cost model; ``shard`` overrides the space's sharding."""
        v = config.virtual
        sharded = self.shard_optimizer if shard is None else shard
        devices = self.devices(config.stages)
        return self.runner.cost_model(
            self.figures(config.micro_batch, config.mean_batch, config.alone)[0],
            [devices[k % config.stages] for k in range(config.stages * v)],
            config.chunks,
            config.checkpoint,
            config.schedule,
            self.optimizer,
            CostOptions(
                data_parallel=config.replicas,
                virtual_stages=v,
                shard_optimizer=sharded,
                colocated=self.one_device,
            ),
        )

    def figures(
        self, micro: int, mean: float, alone: bool = False
    ) -> tuple[LayerCosts, float, float]:
        """Per micro-batch size (and mean size, for times; ``alone``: on one device): the
        layer costs, smallest boundary and the total saved activations."""
        key = (micro, mean, alone)
        if key not in self._at:
            lines = self.lines_alone if alone else self.lines
            costs = lines.at(micro, time_batch=mean)
            boundary = float(costs.output[:-1].min()) if len(costs) > 1 else 0.0
            # Shared bytes count once (more when a cut separates them: a lower bound).
            saved = float((costs.saved - costs.shared_bytes).sum())
            self._at[key] = (costs, boundary, saved)
        return self._at[key]

    def single(self, config: Config) -> float:
        """The least memory of the configuration's largest layer alone on a stage."""
        factor = self.state_factor(config.replicas)
        key = (config.micro_batch, config.mean_batch, config.alone, factor)
        if key not in self._single:
            costs = self.figures(config.micro_batch, config.mean_batch, config.alone)[0]
            state = self.params * factor + self.buffers
            self._single[key] = float(np.max(state + costs.saved + costs.peak))
        return self._single[key]

    def compute(self, micro: int, mean: float, alone: bool, r: float) -> tuple[float, float]:
        """Total and largest per-layer compute with a re-computed share ``r``."""
        key = (micro, mean, alone, r)
        if key not in self._compute:
            costs = self.figures(micro, mean, alone)[0]
            layer = costs.forward * (1 + r) + costs.backward
            self._compute[key] = (float(layer.sum()), float(layer.max()))
        return self._compute[key]

    def bound(self, config: Config) -> tuple[float, bool]:
        """Tier 1: a lower bound on the configuration's value, and whether it may fit."""
        if config.virtual > 1:
            return self._virtual_bound(config)
        costs, boundary, saved = self.figures(config.micro_batch, config.mean_batch, config.alone)
        k, m = config.stages, config.chunks
        fastest = "never" if config.checkpoint == "auto" else config.checkpoint
        r = {"always": 1.0, "except_last": (m - 1) / m, "never": 0.0}[fastest]
        work, largest = self.compute(config.micro_batch, config.mean_batch, config.alone, r)
        send = boundary / self.bandwidth if self.bandwidth and k > 1 else 0.0
        total = work + k * self.overhead + (k - 1) * (send + self.latency)
        bottleneck = max(total / k, largest + self.overhead)
        alpha = 0.0
        if config.replicas > 1 and self.allreduce:
            alpha = 2.0 * (config.replicas - 1) / config.replicas / self.allreduce
        params = max(float(self.params.sum()) / k, float(self.params.max()))
        value = total + (m - 1) * bottleneck + alpha * params
        if self.capacity is None:
            return value, True
        # Summed over stages: state, kept activations, kept boundary inputs, one peak.
        keep = m if config.checkpoint == "never" and config.schedule == "gpipe" else 1
        ck = {"always": m, "except_last": m - 1}.get(config.checkpoint, 0)
        if config.schedule == "1f1b":
            ck = min(ck, 1)
        inputs = ck * (costs.input + (k - 1) * boundary)
        need = self.state(config.replicas) + keep * saved + inputs + float(costs.peak.max())
        return value, self.single(config) <= self.capacity and need <= k * self.capacity

    def _virtual_bound(self, config: Config) -> tuple[float, bool]:
        """Tier 1 for K·v interleaved stages: a device works ``M·C_r`` per step, at least
        the mean ``M·Σc / K``, and one micro-batch passes every stage in turn (``Σc``)."""
        boundary = self.figures(config.micro_batch, config.mean_batch)[1]
        k, m, stages = config.stages, config.chunks, config.stages * config.virtual
        work = self.compute(config.micro_batch, config.mean_batch, False, 0.0)[0]
        send = boundary / self.bandwidth if self.bandwidth else 0.0
        total = work + stages * self.virtual_overhead + (stages - 1) * (send + self.latency)
        alpha = 0.0
        if config.replicas > 1 and self.allreduce:
            alpha = 2.0 * (config.replicas - 1) / config.replicas / self.allreduce
        params = max(float(self.params.sum()) / stages, float(self.params.max()))
        value = max(total, m * total / k) + alpha * params
        return value, self.capacity is None or self.single(config) <= self.capacity


def configurations(
    n_devices: int,
    layers: int,
    batch: int,
    checkpoints: Sequence[str],
    schedules: Sequence[str],
    max_chunks: int | None,
    even: bool = False,
    virtual_stages: Sequence[int] = (1,),
    shard_optimizer: bool = False,
) -> list[Config]:
    """Every configuration of at most ``n_devices`` devices (see :func:`autopipe.search`).

    Replica counts that leave each replica as many samples as one replica fewer does are
    left out: they only add all-reduce work (unless the replicas shard the optimizer state,
    whose share per device more replicas make smaller). With ``even``, only replica and
    micro-batch counts that divide the batch exactly. Virtual stages (v > 1) go with K >= 2,
    K·v layers at most, ``never`` checkpointing (torch's interleaved schedules keep every
    activation) and, for 1F1B, M a multiple of its rounds' micro-batches.
    """
    out = []
    for k in range(1, min(n_devices, layers) + 1):
        for d in range(1, min(n_devices // k, batch) + 1):
            replica = -(-batch // d)
            if d > 1 and replica == -(-batch // (d - 1)) and not shard_optimizer:
                continue
            if even and batch % d:
                continue
            limit = max_chunks or max(32, 16 * k)
            for m, micro in chunk_options(replica, limit):
                if even and m * micro != replica:
                    continue
                for schedule in schedules:
                    if schedule == "1f1b" and m == 1 and "gpipe" in schedules:
                        continue  # one micro-batch: 1F1B is GPipe
                    for mode in checkpoints:
                        if _redundant(mode, m, checkpoints):
                            continue
                        out.append(Config(k, d, m, micro, mode, schedule, replica))
                    for v in virtual_stages:
                        if _interleaves(k, v, m, layers, schedule, checkpoints):
                            out.append(Config(k, d, m, micro, "never", schedule, replica, v))
    return out


def _interleaves(
    stages: int, virtual: int, chunks: int, layers: int, schedule: str, checkpoints: Sequence[str]
) -> bool:
    """Whether ``virtual`` stages per device make a configuration of their own."""
    if virtual < 2 or stages < 2 or stages * virtual > layers or "never" not in checkpoints:
        return False
    per_round = chunks // max(1, chunks // stages)  # interleaved 1F1B's rounds
    return schedule == "gpipe" or chunks % per_round == 0


def _redundant(mode: str, chunks: int, checkpoints: Sequence[str]) -> bool:
    """Whether a mode cannot beat another mode that is searched too.

    With one micro-batch ``except_last`` and ``auto`` are ``never``; ``always`` never beats
    ``except_last``, which re-computes less and keeps no more (``keep`` is 1 for both and
    ``except_last`` keeps at most as many boundary inputs).
    """
    if chunks == 1 and mode in ("except_last", "auto"):
        return "never" in checkpoints
    return mode == "always" and "except_last" in checkpoints
