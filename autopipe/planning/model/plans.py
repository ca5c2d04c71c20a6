"""A pipeline plan as plain data: the split, its predicted costs, and what it came from."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.mesh import Mesh
from autopipe.planning.model.names import (
    ALL_SCHEDULES,
    CHECKPOINT_MODES,
    FIXED_CHECKPOINT_MODES,
)
from profiler import Profile, read_json, write_json

__all__ = ["Plan", "StagePlan", "TiedPlan"]

PLAN_VERSION = 6
# Older plans load too: they lack the fields added since (3: ``shard_optimizer``; 4:
# ``mesh``; 5: the stages' ``recompute_units``; 6: ``mesh.expert``), whose defaults hold
# for them.
_READABLE = (1, 2, 3, 4, 5, 6)
# A stage's checkpoint mode: one of the plan's fixed modes, or ``units``: the stage
# re-computes the units listed in its ``recompute_units`` on every micro-batch.
STAGE_CHECKPOINT_MODES = (*FIXED_CHECKPOINT_MODES, "units")


@dataclass
class StagePlan:
    """One stage of a plan.

    Attributes:
        index: the stage's position in the pipeline.
        device: the device the stage runs on.
        start: index of the stage's first layer.
        stop: one past the index of its last layer.
        layers: names of the stage's layers.
        compute: predicted forward + backward (+ re-computation) seconds per micro-batch.
        transfer: predicted seconds per micro-batch to send its output to the next stage.
        time: ``compute + transfer``, the stage's cost per micro-batch.
        memory: predicted peak bytes on the device.
        param_memory: bytes of parameters, gradients, optimizer state and buffers.
        activation_memory: bytes of saved activations and boundary inputs at the peak.
        capacity: the device's capacity in bytes, or ``None`` for unlimited.
        in_flight: micro-batches whose activations the stage holds at its peak.
        checkpoint: the stage's checkpoint mode (``auto`` plans decide per stage):
            ``never``, ``except_last``, ``always``, or ``units`` (the units of
            ``recompute_units`` re-computed, each on every micro-batch).
        recompute: seconds of forward re-computation per micro-batch, part of ``compute``.
        overhead: the executor's fixed seconds per micro-batch, part of ``compute``.
        allreduce: seconds per step to all-reduce the stage's gradients among replicas.
        forward: seconds of one forward per micro-batch, part of ``compute`` (its share of
            the overhead included); 0 in plans that predate it.
        weight: of the backward, the seconds that compute the weights' gradients (zero
            bubble runs them apart, when a device would otherwise wait).
        tied: bytes of the tied parameters and buffers the stage holds a copy of, part of
            ``param_memory`` (parameters with their gradients and optimizer state).
        update: seconds per step of the optimizer's step on the stage (0 unless
            calibrated: ``update_s_per_byte``).
        recompute_units: with checkpoint ``units``, the layers (indices in the model,
            within ``[start, stop)``, ascending) the stage runs under activation
            checkpointing, each on every micro-batch; else empty.
        alltoall_forward: under ``dualpipev``, of ``forward``, the seconds of the routed
            experts' all-to-alls, which its overlapped pairs hide in part
            (:mod:`autopipe.planning.schedules.schedule_replay`); else 0.
        alltoall_backward: the same of the backward.
    """

    index: int
    device: str
    start: int
    stop: int
    layers: list[str]
    compute: float
    transfer: float
    time: float
    memory: float
    param_memory: float
    activation_memory: float
    capacity: int | None
    in_flight: int
    checkpoint: str = ""
    recompute: float = 0.0
    overhead: float = 0.0
    allreduce: float = 0.0
    forward: float = 0.0
    weight: float = 0.0
    tied: float = 0.0
    update: float = 0.0
    recompute_units: list[int] = field(default_factory=list)
    alltoall_forward: float = 0.0
    alltoall_backward: float = 0.0

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class TiedPlan:
    """A tensor several layers use, and where the plan keeps its copies.

    Attributes:
        names: its names in the model, the first one first.
        stages: the stages holding a copy (every stage with a layer that uses it).
        bytes: the size of one copy (without gradient and optimizer state).
        time: seconds per step to sum the copies' gradients, part of the step time (0
            for one copy, and for a buffer, which has none).
        buffer: a buffer, not a parameter.
    """

    names: list[str]
    stages: list[int]
    bytes: int
    time: float = 0.0
    buffer: bool = False


@dataclass
class Plan:
    """A balanced split of a model into pipeline stages, with its predicted costs.

    Attributes:
        balance: layers per stage (torchgpipe's ``balance``).
        stages: per-stage detail.
        chunks: micro-batches per mini-batch (M).
        micro_batch: samples per micro-batch.
        checkpoint: ``always``, ``except_last``, ``never`` or ``auto`` (see the stages).
        schedule: ``gpipe`` or ``1f1b``.
        strategy: the balancing strategy that chose the split.
        optimizer: name of the optimizer whose state is counted.
        bottleneck: the largest stage cost per micro-batch, seconds.
        bottleneck_stage: index of that stage.
        step_time: predicted seconds per mini-batch, ``Σ c_k + (M−1)·max c_k`` plus the
            all-reduce.
        bubble: predicted idle fraction of the pipeline over a step.
        devices: the devices of one pipeline (one replica) the plan was made for.
        profile: the profile the plan was made from, as a dict.
        version: the JSON schema version.
        data_parallel: replicas of the pipeline (D), each taking ``batch_size / D`` samples.
        batch_size: samples per step across all replicas (0: unknown).
        allreduce: seconds per step of the gradient all-reduce, part of ``step_time``.
        throughput: predicted samples per second, ``batch_size / step_time``.
        notes: why the plan was chosen or how it compares with the best of a search.
        virtual_stages: stages per rank (v); the stages are K·v, stage s on rank
            ``s % K``, and ``step_time`` is the interleaved schedule's (see
            :mod:`autopipe.planning.schedules.interleaving`).
        tied: the tensors several layers use, with the stages holding their copies.
        step_extra: seconds per step of the optimizer's steps beyond the all-reduce that
            overlaps them and of the runner's fixed cost per step (both 0 unless
            calibrated: ``update_s_per_byte``, ``step_overhead_s``).
        tied_time: seconds per step summing tied parameters' gradients between the stages
            holding copies, part of ``step_time``.
        shard_optimizer: the ``data_parallel`` replicas shard each stage's optimizer
            state (ZeRO stage 1): the stages' ``param_memory`` holds a 1/D share of it
            (always ``False`` with one replica; plans before version 3 did not shard).
        shared: groups of stages that share one device and take turns on it (in one
            process, :mod:`autopipe.planning.model.colocation`); empty when every stage has its
            own.
        mesh: the tensor, context and sharded data parallelism around the pipeline
            (:class:`autopipe.planning.model.mesh.Mesh`); the default mesh (``t = c = 1``)
            is the pipeline with plain data-parallel replicas. With ``mesh.zero >= 1``
            ``shard_optimizer`` is true.
        model_flops: FLOPs of one step over all devices as the profile counts them (every
            layer's forward and backward at the batch; no re-computation), 0: not counted.
        peak_flops: the dense peak FLOP/s per device the times were estimated at (0:
            unknown), for the model FLOPs utilization.
        sequence: tokens per sample (0: unknown).
        mesh_parts: seconds per step the busiest rank spends in the mesh's exposed
            communication, by kind (``tensor``: the tensor-parallel collectives,
            ``context``: the ring beyond attention, ``zero``: ZeRO-2/3 exchanges beyond
            compute, ``expert``: the expert-parallel all-to-alls); empty without a mesh.
        device_memory: with virtual stages, each rank's predicted peak bytes: its stages'
            parameters and state, and the most their in-flight micro-batches hold at once
            (its stages do not all peak together); empty with one stage per device.
        recompute_norms: the layers' normalization outputs are re-computed in the backward,
            not kept (Megatron-LM's ``--recompute-modules layernorm``): the figures are
            those of :mod:`autopipe.planning.recomputed_modules`, which ``profile`` records.
        recompute_up_proj: a latent attention's queries, keys and values are re-built from
            its latents in the backward (Megatron-LM's ``mla_up_proj``), likewise.
    """

    balance: list[int]
    stages: list[StagePlan]
    chunks: int
    micro_batch: int
    checkpoint: str
    schedule: str
    strategy: str
    optimizer: str
    bottleneck: float
    bottleneck_stage: int
    step_time: float
    bubble: float
    devices: list[DeviceSpec]
    profile: dict[str, Any] = field(default_factory=dict, repr=False)
    version: int = PLAN_VERSION
    data_parallel: int = 1
    batch_size: int = 0
    allreduce: float = 0.0
    throughput: float = 0.0
    notes: list[str] = field(default_factory=list)
    virtual_stages: int = 1
    tied: list[TiedPlan] = field(default_factory=list)
    tied_time: float = 0.0
    shard_optimizer: bool = False
    shared: list[list[int]] = field(default_factory=list)
    step_extra: float = 0.0
    mesh: Mesh = field(default_factory=Mesh)
    model_flops: float = 0.0
    peak_flops: float = 0.0
    sequence: int = 0
    mesh_parts: dict[str, float] = field(default_factory=dict)
    device_memory: list[float] = field(default_factory=list)
    recompute_norms: bool = False
    recompute_up_proj: bool = False

    @property
    def pipeline_time(self) -> float:
        """Seconds per step of the pipeline alone: ``step_time`` less the all-reduce, the
        tied parameters' gradient sums and the optimizer's and runner's costs per step."""
        return self.step_time - self.allreduce - self.tied_time - self.step_extra

    @property
    def num_devices(self) -> int:
        """Devices the plan occupies: ranks per pipeline times data-parallel replicas
        times the tensor × context group of each stage (stages sharing a device count
        once)."""
        own = self.num_stages - sum(len(group) - 1 for group in self.shared)
        return own // self.virtual_stages * self.data_parallel * self.mesh.inner

    @property
    def tokens_per_device(self) -> float:
        """Predicted tokens per second per device (0 when ``sequence`` is unknown)."""
        devices = self.num_devices
        return self.throughput * self.sequence / devices if devices else 0.0

    @property
    def flops_per_device(self) -> float:
        """Predicted model FLOP/s per device (``model_flops`` over the step; 0: unknown)."""
        devices = self.num_devices
        return self.model_flops / self.step_time / devices if self.step_time and devices else 0.0

    @property
    def utilization(self) -> float:
        """Model FLOPs utilization: ``flops_per_device / peak_flops`` (0: unknown)."""
        return self.flops_per_device / self.peak_flops if self.peak_flops else 0.0

    @property
    def stage_checkpoints(self) -> list[str]:
        """Each stage's checkpoint mode."""
        return [stage.checkpoint or self.checkpoint for stage in self.stages]

    @property
    def efficiency(self) -> float:
        """Busy fraction of the pipeline over a step: ``1 - bubble``."""
        return 1.0 - self.bubble

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    def check_runnable(self, runner: str) -> None:
        """Refuses a plan that asks ``runner`` (one of autopipe's) for what it does not run.

        Raises:
            ValueError: the plan re-computes the norms or the up-projections alone
                (:attr:`recompute_norms`, :attr:`recompute_up_proj`): autopipe's runners
                re-compute whole units, and would run it keeping their outputs, holding
                more than the plan predicts.
        """
        for flag, what in (
            ("recompute_norms", "the norms"),
            ("recompute_up_proj", "the attention's up-projections"),
        ):
            if getattr(self, flag):
                raise ValueError(
                    f"the plan re-computes {what} alone ({flag}), which {runner} does not "
                    f"run (it re-computes whole units): plan without {flag} to run here, "
                    "or export this plan to Megatron-LM"
                )

    def export(self, fmt: str) -> str:
        """The split as another runtime takes it, as text to paste or save.

        Formats (:data:`autopipe.planning.runtimes.export_formats.EXPORT_FORMATS`): ``torch`` and
        ``torch-json``, the ``split_spec`` of ``torch.distributed.pipelining.pipeline``;
        ``torchtitan`` (TOML) and ``torchtitan-json``, its ``[parallelism]`` settings
        (the mesh's degrees, the schedule, ``module_fqns_per_model_part``), activation
        checkpointing and batch sizes; ``megatron``, Megatron-LM's arguments (the mesh's
        parallel sizes, ``--pipeline-model-parallel-layout`` for decoder-only models, the
        distributed optimizer, batch sizes, re-computation); ``deepspeed`` (JSON), the
        layer boundaries of a ``PipelineModule``.

        Raises:
            ValueError: an unknown format, or a split it cannot express (the message
                names the cut).
        """
        from autopipe.planning.runtimes.export_formats import export_plan

        return export_plan(self, fmt)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["efficiency"] = self.efficiency
        if not self.tied:  # plans of untied models read as before tied state was planned
            del data["tied"], data["tied_time"]
            for stage in data["stages"]:
                del stage["tied"]
        for stage in data["stages"]:  # plans without dualpipev's overlap read as before
            if not (stage["alltoall_forward"] or stage["alltoall_backward"]):
                del stage["alltoall_forward"], stage["alltoall_backward"]
        if not self.shared:  # plans for devices of their own read as before
            del data["shared"]
        if not self.step_extra:
            del data["step_extra"]
        for name in ("model_flops", "peak_flops", "sequence", "mesh_parts", "device_memory"):
            if not data[name]:  # plans without a mesh search read as before
                del data[name]
        if self.mesh == Mesh():  # plans of the pipeline alone read as before
            del data["mesh"]
        else:
            data["mesh"] = self.mesh.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        version = data.get("version")
        if version not in _READABLE:
            raise ValueError(
                f"plan format version {version!r} is not supported (expected {PLAN_VERSION}); "
                "re-create it with `autopipe plan`"
            )
        skip = ("stages", "devices", "efficiency", "tied", "mesh")
        fields = {k: v for k, v in data.items() if k not in skip}
        # Version 1 had one checkpoint mode for all stages.
        stages = [{"checkpoint": data["checkpoint"], **s} for s in data["stages"]]
        fields["version"] = PLAN_VERSION
        plan = cls(
            stages=[StagePlan(**s) for s in stages],
            devices=[DeviceSpec.from_dict(d) for d in data["devices"]],
            tied=[TiedPlan(**t) for t in data.get("tied", [])],
            mesh=Mesh.from_dict(data.get("mesh", {})),
            **fields,
        )
        _check_plan(plan)
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the plan as JSON, atomically."""
        write_json(path, "plan", self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Reads a plan written by :meth:`save`.

        Raises:
            ValueError: the file is not a plan of a supported version.
        """
        data = read_json(path, "plan")
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path} is not a valid autopipe plan: {exc}") from None
        except ValueError as exc:  # name the file: the message names the field
            raise ValueError(f"{path}: {exc}") from None


_REMAKE = "re-create the plan with `autopipe plan`"


def _count(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} is {value!r}; it must be an integer >= 1")
    return value


_PLAN_AMOUNTS = (
    "bottleneck",
    "step_time",
    "bubble",
    "allreduce",
    "throughput",
    "tied_time",
    "step_extra",
    "model_flops",
    "peak_flops",
)
_STAGE_AMOUNTS = (
    "compute", "transfer", "time", "memory", "param_memory", "activation_memory",
    "recompute", "overhead", "allreduce", "forward", "weight", "tied",
    "alltoall_forward", "alltoall_backward",
)  # fmt: skip


def _check_amounts(item: object, where: str, names: tuple[str, ...]) -> None:
    """Each predicted figure is a finite number >= 0 (JSON lets NaN and Infinity in)."""
    for name in names:
        value = getattr(item, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}{name} is {value!r}; it must be a finite number >= 0")


def _check_stage_checkpoint(stage: StagePlan, where: str) -> None:
    """A stage's mode is one a stage runs, and ``units`` lists units of the stage."""
    mode = stage.checkpoint
    if mode and mode not in STAGE_CHECKPOINT_MODES:
        raise ValueError(
            f"{where}.checkpoint is {mode!r}; choose {', '.join(STAGE_CHECKPOINT_MODES)}"
        )
    units = stage.recompute_units
    ok = isinstance(units, list) and all(
        isinstance(u, int) and not isinstance(u, bool) and stage.start <= u < stage.stop
        for u in units
    )
    if not ok or units != sorted(set(units)):
        raise ValueError(
            f"{where}.recompute_units is {units!r}; it must list distinct layer indices of "
            f"the stage ({stage.start} to {stage.stop - 1}), ascending"
        )
    if (mode == "units") != bool(units):
        raise ValueError(
            f"{where} has checkpoint {mode!r} and recompute_units {units}: a stage lists "
            "the units it re-computes exactly when its checkpoint is 'units'"
        )


def _check_plan(plan: Plan) -> None:
    """The balance, the stages and the devices describe one split (a loaded file may
    have been edited so that they contradict each other)."""
    if not isinstance(plan.balance, list) or not plan.balance:
        raise ValueError(f"balance is {plan.balance!r}; it must be a non-empty list")
    for k, size in enumerate(plan.balance):
        _count(size, f"balance[{k}]")
    for what in ("chunks", "micro_batch", "data_parallel", "virtual_stages"):
        _count(getattr(plan, what), what)
    if not isinstance(plan.shard_optimizer, bool):
        raise ValueError(f"shard_optimizer is {plan.shard_optimizer!r}; it must be true or false")
    _check_amounts(plan, "", _PLAN_AMOUNTS)
    for k, stage in enumerate(plan.stages):
        _check_amounts(stage, f"stages[{k}].", _STAGE_AMOUNTS)
    memory = plan.device_memory
    if not isinstance(memory, list) or not all(
        isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) and m >= 0
        for m in memory
    ):
        raise ValueError(f"device_memory is {memory!r}; it must list finite numbers >= 0")
    if len(plan.stages) != len(plan.balance):
        raise ValueError(
            f"balance {plan.balance} has {len(plan.balance)} stages but stages lists "
            f"{len(plan.stages)}; {_REMAKE}"
        )
    start = 0
    for k, (stage, size) in enumerate(zip(plan.stages, plan.balance)):
        span = (stage.index, stage.start, stage.stop)
        if span != (k, start, start + size) or len(stage.layers) != size:
            raise ValueError(
                f"stages[{k}] (index {stage.index}, start {stage.start}, stop {stage.stop}, "
                f"{len(stage.layers)} layer names) contradicts balance {plan.balance}, by "
                f"which stage {k} holds layers {start} to {start + size - 1}; {_REMAKE}"
            )
        start += size
    if len(plan.devices) != len(plan.stages):
        raise ValueError(
            f"devices lists {len(plan.devices)} devices for {len(plan.stages)} stages; {_REMAKE}"
        )
    if len(plan.stages) % plan.virtual_stages:
        raise ValueError(
            f"{len(plan.stages)} stages do not split into virtual_stages "
            f"{plan.virtual_stages} per device; {_REMAKE}"
        )
    if plan.schedule not in ALL_SCHEDULES:
        raise ValueError(f"schedule is {plan.schedule!r}; choose {', '.join(ALL_SCHEDULES)}")
    ranks = plan.data_parallel * plan.mesh.context
    if ranks % plan.mesh.expert:
        raise ValueError(
            f"mesh expert {plan.mesh.expert} does not divide the data-parallel replicas times "
            f"the context-parallel degree ({ranks}); {_REMAKE}"
        )
    if plan.checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint is {plan.checkpoint!r}; choose {', '.join(CHECKPOINT_MODES)}")
    for k, stage in enumerate(plan.stages):
        _check_stage_checkpoint(stage, f"stages[{k}]")
    if not isinstance(plan.profile, dict):
        raise ValueError(f"profile must be an object, got {plan.profile!r}")
    if not plan.profile:  # plans may be saved without their profile
        return
    try:  # the report and the simulation read it
        layers = len(Profile.from_dict(plan.profile))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"profile: {exc}") from None
    if layers != start:
        raise ValueError(
            f"balance {plan.balance} splits {start} layers but the plan's profile has "
            f"{layers}; {_REMAKE}"
        )
