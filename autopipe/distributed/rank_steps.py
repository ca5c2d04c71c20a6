"""A rank's part of the build path: arguments agreed by every rank, the plan made on rank 0.

:func:`autopipe.microbatching.assembly.assemble` runs the steps in their order; here each
is what one rank of :class:`autopipe.distributed.runner.PipelineRunner` does at it, with
the collectives that keep the ranks together: every rank checks its arguments and the
ranks compare them before anything can hang on a disagreement, rank 0 profiles, plans and
measures the boundary tensors, and the ranks agree that each could initialize its stages.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autopipe.distributed.collectives import share_from_rank0
from autopipe.distributed.meta_stages import init_problem
from autopipe.distributed.padding import MicroBatchPadding, per_batch_problem
from autopipe.distributed.prepared import Prepared, prepare_model
from autopipe.distributed.replicas import (
    check_layout,
    data_parallel_problem,
    make_layout,
    replica_sample,
)
from autopipe.distributed.setup import (
    agree,
    boundary_specs,
    check_arguments,
    check_given_plan,
    check_sizes,
    fingerprint_settings,
    rank0_plan,
    rank0_profile,
)
from autopipe.distributed.stage import (
    checkpoint_problem,
    fingerprint,
    plan_checkpoint_problem,
    split_backward_problem,
)
from autopipe.distributed.tensor_parallel import tensor_parallel_problem
from autopipe.distributed.tied_gradients import shared_state, written_shared
from autopipe.distributed.v_stages import (
    check_v_sizes,
    is_v_schedule,
    stage_positions,
    v_plan,
    v_stage_indices,
)
from autopipe.distributed.virtual import stage_indices, virtual_problem
from autopipe.graph import has_meta_state
from autopipe.microbatching import Layers
from autopipe.planning import PipelineSettings, Plan
from profiler import Profile, check_autocast

if TYPE_CHECKING:
    from autopipe.distributed.runner import PipelineRunner

__all__: list[str] = []  # internal to the distributed runner


@dataclasses.dataclass
class RankInputs:
    """What a rank's constructor was given besides the settings.

    Attributes:
        model: the model.
        sample: one mini-batch of the model's positional inputs.
        loss_fn: the loss.
        plan: a given plan, or ``None``.
        profile: a given profile, or ``None``.
        data_parallel: D as given (``None``: the plan's, or 1).
        prepared: the model as a search already prepared it, or ``None``.
        plan_shared: ``plan`` is the same object on every rank (a search broadcast it).
        calibration: measures the runner's figures on every rank before rank 0 plans
            (``calibrate=True``), returning them, or ``None`` when it measured nothing.
        tp_plan: the tensor-parallel plan given, or ``None`` for the model's own.
    """

    model: nn.Module
    sample: Any
    loss_fn: Any
    plan: Plan | None
    profile: Any
    data_parallel: int | None
    prepared: Prepared | None = None
    plan_shared: bool = False
    calibration: Callable[[PipelineRunner, Any], Mapping[str, float] | None] | None = None
    tp_plan: Mapping[str, str] | None = None


class RankSteps:
    """One rank's steps of the build path; they set the runner's layout as they learn it
    (:attr:`PipelineRunner.layout`, its stage and replica, the batch per replica).

    After :func:`autopipe.microbatching.assembly.assemble` has run them, :attr:`prepared`,
    :attr:`sample` (replica 0's rows), :attr:`padding` and :attr:`specs` (the tensors
    leaving every layer, for one micro-batch) are what the runner builds its stages with.
    """

    def __init__(self, runner: PipelineRunner, given: RankInputs, settings: PipelineSettings):
        self.runner, self.inputs, self.settings = runner, given, settings
        self.given: Plan | None = given.plan
        self.prepared = given.prepared
        self.sample: Any = given.sample
        self.specs: list[Any] = []
        self.padding: MicroBatchPadding | None = None
        self.world = dist.get_world_size(runner.group)
        self.meta = has_meta_state(given.model)
        self.measured: Mapping[str, float] | None = None  # the runner's figures, if measured

    def layers(self) -> Layers:
        inputs, settings, runner = self.inputs, self.settings, self.runner
        self.prepared = self.prepared or prepare_model(inputs.model, inputs.sample)
        layers = OrderedDict(self.prepared.sequential.named_children())
        self.sample = self.prepared.sample
        chunks, schedule = settings.chunks, settings.schedule
        problem = check_arguments(layers, self.sample, chunks, schedule, inputs.loss_fn, self.given)
        rows = (self.sample,) if isinstance(self.sample, torch.Tensor) else self.sample
        per_batch = self.prepared.per_micro_batch
        problem = problem or per_batch_problem(per_batch, len(rows[0]), chunks or 1)
        problem = problem or data_parallel_problem(runner.data_parallel)
        problem = problem or virtual_problem(settings.virtual_stages)
        problem = problem or checkpoint_problem(str(settings.checkpoint))
        problem = problem or plan_checkpoint_problem(self.given, str(schedule))
        problem = problem or split_backward_problem(str(schedule), str(settings.checkpoint))
        problem = problem or init_problem(inputs.model, self.meta, settings.init)
        problem = problem or tensor_parallel_problem(
            inputs.model, settings.tensor_parallel, inputs.tp_plan, str(schedule),
            settings.virtual_stages,
        )  # fmt: skip
        if not problem and settings.tensor_parallel > 1 and self.meta:
            problem = "tensor_parallel > 1 needs a model with values, not on the meta device"
        check_autocast(settings.autocast)
        if problem:
            raise ValueError(problem)
        return Layers(layers, self.prepared, written=self.prepared.written)

    def agree(self, layers: Layers | None, deferred: bool, error: Exception | None) -> None:
        runner, settings, inputs = self.runner, self.settings, self.inputs
        problem = None if error is None else str(error)
        chunks, schedule = int(settings.chunks or 0), str(settings.schedule)
        shown: dict[str, Any] = {}
        if problem is None:
            shown = fingerprint_settings(self.sample, chunks, schedule, self.given, inputs.profile)
        shown["data_parallel"] = runner.data_parallel
        shown["virtual_stages"] = settings.virtual_stages
        shown["balance"] = runner._balance
        shown["zero"] = runner.zero
        shown["tensor_parallel"] = settings.tensor_parallel
        shown["tp_plan"] = sorted((inputs.tp_plan or {}).items())
        shown["autocast"] = settings.autocast
        shown["checkpoint"] = settings.checkpoint
        shown["deferred_batch_norm"] = deferred
        shown["meta device"] = self.meta  # the ties' broadcast needs every rank alike
        modules = layers.modules if layers is not None and problem is None else {}
        agree(runner.rank, self.world, problem, fingerprint(modules, **shown) if modules else {})
        assert layers is not None  # agree raised otherwise
        d, v = runner.data_parallel, settings.virtual_stages
        t = settings.tensor_parallel
        k = check_layout(self.world, d, inputs.data_parallel, self.given, t)
        check_sizes(k, len(layers.modules), self.given, schedule, chunks, data_parallel=d,
                    virtual_stages=v)  # fmt: skip
        if is_v_schedule(schedule):
            given = self.given
            balance = given.balance if given is not None else runner._balance
            # A given plan's own modes are used instead of the setting.
            modes = set(given.stage_checkpoints) if given is not None else {settings.checkpoint}
            mode = "/".join(sorted(str(m) for m in modes))
            check_v_sizes(schedule, k, len(layers.modules), chunks, balance, data_parallel=d,
                          tensor_parallel=t, virtual_stages=v, checkpoint=mode)  # fmt: skip
        # Rank 0 profiles one replica's rows and plans D replicas of the global batch.
        runner.batch_size, self.sample = replica_sample(self.sample, d, chunks, self.given)
        self.padding = MicroBatchPadding(runner.batch_size, chunks)
        runner.layout = layout = make_layout(runner.group, d, runner.device, t)
        runner.stage_index, runner.num_stages = layout.stage, k
        runner.replica_index = layout.replica
        batch = runner.batch_size
        self.settings = dataclasses.replace(
            settings,
            data_parallel=d,
            batch=d * batch if d > 1 else None,
            # Uneven micro-batches run padded to the largest.
            padded=settings.padded or bool(batch % chunks),
        )

    def plan(self, layers: Layers, make: Callable[[], Plan]) -> Plan:
        assert self.prepared is not None
        sequential, sample = self.prepared.sequential, self.sample
        chunks, autocast = int(self.settings.chunks or 1), self.settings.autocast
        measure = self.inputs.calibration
        if measure is not None and self.given is None:  # a collective: every rank measures
            self.measured = measure(self.runner, self.inputs.profile)

        def on_rank0() -> tuple[dict[str, Any] | None, list[Any]]:
            if self.given is not None:
                check_given_plan(self.given, chunks, str(self.settings.schedule))
            made = make()
            specs = boundary_specs(sequential, sample, chunks, autocast)
            # A plan every rank already holds needs no second trip; a given one does, as
            # the ranks agreed only on its balance.
            return (None if self.inputs.plan_shared else made.to_dict()), specs

        what, failed = "receive the plan from rank 0", "rank 0 could not plan the pipeline"
        group = self.runner.group
        planned, self.specs = share_from_rank0(on_rank0, group, what=what, failed=failed)
        if planned is None:
            assert self.given is not None  # plan_shared: the plan every rank was given
            return self.given
        return Plan.from_dict(planned)

    def profile(self, layers: Layers) -> Profile:
        assert self.prepared is not None
        prepared, runner = self.prepared, self.runner
        # The model's own layers are measured, not their deferred views.
        return rank0_profile(
            prepared.sequential,
            self.sample,
            runner.device,
            self.inputs.profile,
            self.settings,
            owner=prepared.owner,
            tp_plan=self.inputs.tp_plan,
        )

    def make_plan(self, layers: Layers, profile: Profile) -> Plan:
        assert self.prepared is not None
        runner, prepared = self.runner, self.prepared
        stages = runner.num_stages * self.settings.virtual_stages
        if is_v_schedule(self.settings.schedule):  # the given split, or the optimal V one
            chunks = int(self.settings.chunks or 1)
            return v_plan(
                profile,
                runner._balance,
                2 * runner.num_stages,
                (self.settings.schedule, chunks, self.settings.optimizer),
            )
        named = prepared.owner if prepared.owner is not None else prepared.sequential
        unsplit = written_shared(list(prepared.sequential), layers.written, named)
        return rank0_plan(
            profile, stages, runner.num_stages, self.settings, unsplit, measured=self.measured
        )

    def check_placement(self, layers: Layers, plan: Plan) -> None:
        assert self.prepared is not None
        sequential = self.prepared.sequential
        where = stage_positions(str(self.settings.schedule), self.runner.num_stages)
        shared = shared_state(list(sequential), plan.balance, where, layers.written)
        if shared:
            raise ValueError(shared)

    def stage_devices(self, plan: Plan) -> dict[int, str | torch.device]:
        runner = self.runner
        if is_v_schedule(self.settings.schedule):
            mine = v_stage_indices(runner.stage_index, runner.num_stages)
        else:
            mine = stage_indices(
                runner.stage_index, runner.num_stages, self.settings.virtual_stages
            )
        return {stage: runner.device for stage in mine}

    def materialized(self, error: ValueError | None) -> None:
        # A stage that cannot be initialized is refused on every rank, none waiting.
        agree(self.runner.rank, self.world, None if error is None else str(error), {})
