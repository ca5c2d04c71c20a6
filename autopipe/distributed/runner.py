"""One rank's part of a planned pipeline, K stages times D replicas, on torch pipelining."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.distributed.collectives import collective, rank_device
from autopipe.distributed.failures import FailureBoard, rank_names
from autopipe.distributed.meta_stages import broadcast_ties
from autopipe.distributed.prepared import (
    Prepared,
    original_names,
    state_keys,
    tensor_names,
    unheld_state,
)
from autopipe.distributed.rank_steps import RankInputs, RankSteps
from autopipe.distributed.replicas import (
    ReplicaLayout,
    ReplicaSync,
    resolve_data_parallel,
    take_shard,
)
from autopipe.distributed.setup import agree_on_step, batch_tensors, check_like_sample
from autopipe.distributed.sharded_replicas import (
    replica_mesh,
    resolve_zero,
    shard_stages,
    whole,
    zero_problem,
)
from autopipe.distributed.stage import LossRecorder, StageModule, merge_state_dicts
from autopipe.distributed.step_trace import StepRecorder, track_label
from autopipe.distributed.tensor_parallel import (
    TensorParallel,
    full_state,
    placed_styles,
)
from autopipe.distributed.tied_gradients import TiedGradients, make_tie_groups, shared_across_stages
from autopipe.distributed.v_stages import is_v_schedule, stage_positions, v_settings
from autopipe.distributed.virtual import build_stages, make_schedule, stage_states
from autopipe.graph import model_tp_plan
from autopipe.microbatching import Assembly, assemble
from autopipe.output import check_trace_path
from autopipe.planning import PLAN_FIELDS, PipelineSettings, Plan, with_overrides
from profiler import autocast_pass, current_autocast

__all__: list[str] = []  # internal: DistributedPipeline is the public class


# The settings a runner takes as keywords: planning's, but those it sets itself (the batch,
# padding, colocation), and how the stages run.
RUNNER_FIELDS = (PLAN_FIELDS - {"batch", "padded", "colocated"}) | {
    "autocast",
    "deferred_batch_norm",
    "init",
    "tensor_parallel",
}


class PipelineRunner:
    """This rank's stage of a planned pipeline: all of DistributedPipeline but ``from_search``.

    The ranks' calibration times steps of this class and the search calibrates, so the
    search's constructor sits above both, in :class:`autopipe.distributed.DistributedPipeline`
    (see there for the arguments). A search hands over what it already did on every rank
    by setting :attr:`_handover` on the instance before calling ``__init__``: the model as
    :func:`autopipe.distributed.prepared.prepare_model` made it, and that the given plan is
    the same object on every rank (rank 0 then sends only the boundary tensors' shapes).
    """

    _handover: tuple[Prepared, bool] | None = None
    # Set by DistributedPipeline(calibrate=True): measures the runner's figures once on
    # every rank before rank 0 plans (the calibration sits above this class).
    _calibration: Callable[[PipelineRunner, Any], Mapping[str, float] | None] | None = None
    layout: ReplicaLayout  # the pipeline and replica groups, set by the build path

    def __init__(
        self,
        model: nn.Module,
        sample: Tensor | tuple[Tensor, ...],
        settings: PipelineSettings | None = None,
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        plan: Plan | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        profile: Any = None,
        **overrides: Any,
    ) -> None:
        # ``tp_plan``: the tensor-parallel plan (module-name patterns to styles) for
        # ``tensor_parallel`` above 1; default the model's own Hugging Face plan.
        tp_plan: Mapping[str, str] | None = overrides.pop("tp_plan", None)
        # ``balance``: layers per stage of a V schedule's 2K stages, instead of the planned split.
        self._balance: list[int] | None = overrides.pop("balance", None)
        zero = resolve_zero(overrides.pop("zero", None), plan)  # sharded_replicas
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedPipeline needs an initialised process group: call "
                "autopipe.distributed.init_distributed() (or init_process_group) first"
            )
        # plan_options: the settings planning reads, as older callers pass them.
        extra = dict(overrides.pop("plan_options", None) or {})
        settings = with_overrides(settings, overrides, "DistributedPipeline", RUNNER_FIELDS)
        settings = with_overrides(settings, extra, "DistributedPipeline (plan_options)")
        settings = v_settings(settings, self._balance).resolved(distributed=True)
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        # Before K is known (it needs D agreed) the rank stands for the stage in messages.
        self.stage_index, self.num_stages, self.replica_index = self.rank, world, 0
        given_d = settings.data_parallel
        self.data_parallel: int = resolve_data_parallel(given_d, plan, world)
        self.device = torch.device(device) if device is not None else rank_device(group)
        self.chunks: int = settings.chunks  # type: ignore[assignment]  # checked on every rank
        self.schedule_name = str(settings.schedule)
        self.virtual_stages = settings.virtual_stages
        self.autocast = settings.autocast
        self.tensor_parallel = settings.tensor_parallel
        self.tensor_index = 0
        problem = zero_problem(zero, self.data_parallel, self.tensor_parallel)
        if problem is not None:  # the same arguments on every rank: refused on every rank
            raise ValueError(problem)
        self.zero: int = zero if self.data_parallel > 1 else 0
        self._tp: TensorParallel | None = None
        self._tp_plan = tp_plan
        self.stage_indices: list[int] = []
        self.batch_size = 0
        self._steps = 0
        self._broken = False
        prepared, plan_shared = self._handover or (None, False)
        given = RankInputs(
            model, sample, loss_fn, plan, profile, given_d, prepared, plan_shared,
            self._calibration, tp_plan,
        )  # fmt: skip
        settings = dataclasses.replace(settings, data_parallel=self.data_parallel)
        steps = RankSteps(self, given, settings)
        built = assemble(model, settings, steps)
        if built.warning:  # at the call of DistributedPipeline
            warnings.warn(built.warning, stacklevel=2)
        assert steps.prepared is not None and steps.padding is not None
        self._model, self._padding, self._meta = steps.prepared, steps.padding, steps.meta
        self.plan = built.plan
        self._build(built, steps.sample, steps.specs, loss_fn, model)

    def _build(
        self, built: Assembly, sample: Any, specs: list[Any], loss_fn: Any, model: nn.Module
    ) -> None:
        k, micro = self.num_stages, self._padding.rows
        self.stage_indices = list(built.stage_devices)
        layers = built.layers.modules
        self.module, stages = build_stages(
            layers,
            self.plan,
            self.stage_indices,
            sample,
            specs,
            micro,
            self.chunks,
            self.schedule_name,
        )
        self._original = original_names(self.module, model)  # before moving replaces buffers
        # Tensors of several stages, found by identity before moving replaces buffers; the
        # parameters among them have a copy on each rank using them (TiedGradients).
        where = stage_positions(self.schedule_name, k)
        shared = shared_across_stages(list(layers.values()), self.plan.balance, where)
        self._keys = state_keys(model)
        self._unheld = unheld_state(model, [*layers.values(), *built.layers.originals])
        owners = tensor_names(model)
        self._shared = {owners.get(id(t)) for t, _ in shared} - {None}
        self.module.to(self.device)
        ties = [(t, where) for t, where in shared if isinstance(t, nn.Parameter)]
        if self.layout.tensor_mesh is not None:
            self._shard(ties, model)
        groups = make_tie_groups(ties, self.layout, self.group, self.device)
        self._tied = TiedGradients(ties, groups, self.stage_index)
        if self._meta:  # each holder initialized its copy: the first one's values win
            collective(self.rank, "share the tied parameters", broadcast_ties, self._tied.parts)
        sharded = self.zero >= 2
        self._sync = ReplicaSync(self.module, self.layout, reduce_gradients=not sharded)
        collective(self.rank, "receive replica 0's state", self._sync.broadcast_state)
        if sharded:  # from equal replicas: each keeps its shard of the same values
            self._shard_replicas(ties)
        if self._model.wrapped:  # the loss sees the model's outputs, not the flat tensors
            rebuild, inner = self._model.rebuild, loss_fn
            loss_fn = lambda out, tgt: inner(rebuild(out, self.module.training), tgt)  # noqa: E731
        self._loss = LossRecorder(self._padding.loss(loss_fn), self.chunks)
        total, group = k * self.virtual_stages, self.layout.pipeline
        self.schedule, self.stages, self._step_extra = make_schedule(
            self.schedule_name, stages, total, self.device, group, self.chunks, self._loss
        )
        self.stage = self.stages[0]
        names = rank_names(k, self.data_parallel, self.tensor_parallel)
        self._failures = FailureBoard.for_group(self.group, names)

    def _shard(self, ties: list[Any], model: nn.Module) -> None:
        """Shards this rank's layers over its stage's tensor-parallel ranks.

        Raises:
            ValueError: a parameter is tied across stages, or a style names a module that
                is not ``nn.Linear`` or ``nn.Embedding`` (the same on every rank).
        """
        if ties:
            raise ValueError(
                "tensor_parallel > 1 does not take parameters used by stages on several "
                "ranks (tied embeddings): untie them or plan their users onto one stage"
            )
        mesh = self.layout.tensor_mesh
        assert mesh is not None
        self.tensor_index = mesh.get_local_rank()
        plan = (model_tp_plan(model) or {}) if self._tp_plan is None else self._tp_plan
        layers = [layer for stage in self.module.modules() if isinstance(stage, StageModule)
                  for layer in stage.children()]  # fmt: skip
        self._tp = TensorParallel(layers, model, placed_styles(model, plan, mesh.size()), mesh)

    def _shard_replicas(self, ties: list[Any]) -> None:
        """Shards this rank's stages over its replicas (ZeRO-2/3, ``fully_shard`` per unit).

        Raises:
            ValueError: a parameter is tied across stages (the same on every rank).
        """
        if ties:
            raise ValueError(
                f"zero={self.zero} does not take parameters used by stages on several ranks "
                "(tied embeddings): untie them, plan their users onto one stage, or pass zero=0"
            )
        assert self.layout.replicas is not None
        shard_stages(self.module, replica_mesh(self.layout.replicas, self.device.type), self.zero)

    # With virtual stages, position 0 holds stage 0 and position K−1 the last stage, K·v−1;
    # under a V schedule position 0 holds both.
    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (and reads the inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (reads the targets, returns the loss)."""
        if is_v_schedule(self.schedule_name):
            return self.stage_index == 0
        return self.stage_index == self.num_stages - 1

    def step(
        self, inputs: Any = None, target: Any = None, *, trace: str | os.PathLike[str] | None = None
    ) -> Tensor | None:
        """Runs forward and backward of one mini-batch through the pipeline.

        Call it on every rank with the same mini-batch; only the first stage reads
        ``inputs`` (the model's positional inputs, as the sample) and only the last reads
        ``target`` (others may pass ``None``). Gradients
        are added to the ``.grad`` of :attr:`module`'s parameters, as ``backward`` would.
        With D replicas, each argument is either the global mini-batch (D·b rows, of which
        replica r takes rows ``[r*b, (r+1)*b)``) or this replica's shard (b rows, as a
        ``DistributedSampler`` gives); the gradients then are those of the mean loss over
        all D·M micro-batches.

        Args:
            inputs: the mini-batch's inputs (read on the first stage).
            target: its targets (read on the last stage).
            trace: a ``.json`` file: time every rank's forwards, backwards, loss and
                sends and receives in this step and write them on rank 0 as a Chrome
                trace, one track per rank, named as ``autopipe plan --trace`` names the
                predicted step (:mod:`autopipe.distributed.step_trace`). Pass it on every
                rank (rank 0's path is written); the step's results are the same.

        Returns:
            On the last stage's ranks, the mean of ``loss_fn`` over the micro-batches of
            all replicas (detached); ``None`` on the other ranks.

        Raises:
            ValueError: a mini-batch of another size than the sample's (or, with replicas,
                than the global and the per-replica batch), inputs of other shapes past
                dim 0 or dtypes than the sample's, or a step under another autocast than
                the pipeline's (its stages would exchange tensors of the wrong dtype), or
                a ``trace`` rank 0 cannot write (not ``.json``, no such directory). The
                ranks agree on it before the step sends anything: a step refused on one
                rank is refused on every rank (the message names the rank), and the
                pipeline can run the next one.
            RuntimeError: a step failed on this or another rank before (the pipeline's
                ranks are out of step then), another rank failed or exited during this
                step (the error names it and its error, see
                :mod:`autopipe.distributed.failures`), or the process group timed out.
            OSError: rank 0 could not write the ``trace`` file; the step itself ran, and
                the pipeline can run the next one.
        """
        if self._broken:
            raise RuntimeError("an earlier step failed; this pipeline cannot run again")
        problem: str | None = None
        failure: Exception | None = None
        try:
            args, kwargs = self._arguments(inputs, target)
            if trace is not None and self.rank == 0:
                check_trace_path(trace)
        except (ValueError, TypeError) as exc:
            args, kwargs, problem = (), {}, str(exc)
        except Exception as exc:  # e.g. out of memory moving the batch: still tell the others
            args, kwargs, problem, failure = (), {}, f"{type(exc).__name__}: {exc}", exc
        # Every rank learns whether any rank refuses the step before it sends anything: a
        # rank that went ahead alone would pair this step's messages with the next one's.
        try:
            agree_on_step(self.rank, self.group, self.device, self._steps, problem)
        except RuntimeError:
            self._broken = True
            raise
        except ValueError:
            if failure is not None:
                raise failure from None
            raise
        self._loss.values.clear()
        try:
            # The copies' gradients are summed after the replicas' average: every copy then
            # sums the same averaged values, in the same group order on every replica, so the
            # copies stay bitwise equal however many replicas reduce in whichever order.
            tied, sync = self._tied.step(), self._sync.step()
            # Inside the replicas' average: the shards' partial gradients are completed first.
            sharded = self._tp.step() if self._tp is not None else contextlib.nullcontext()
            recorder = None
            if trace is not None:  # every rank times its part of the step
                recorder = StepRecorder(self.stages, self.schedule, self.device, self.group)
            timed = recorder or contextlib.nullcontext()
            with tied, sync, sharded, autocast_pass(self.device.type, self.autocast), timed:
                self.schedule.step(*args, **kwargs)
            loss = self._sync.mean_loss(self._loss.mean()) if self.is_last else None
        except BaseException as exc:
            self._broken = True
            named = self._failures.failed(self._steps, exc)
            if named is not None:  # another rank's failure: say which, not the backend's words
                raise named from exc
            raise
        self._steps += 1
        if recorder is not None and trace is not None:  # after the step: it stays usable
            label = track_label(self.stage_indices, self.replica_index, self.data_parallel)
            recorder.write(trace, self.plan, label)
        return loss

    def _arguments(self, inputs: Any, target: Any) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
        """What this rank's stages take from a step's arguments, checked; sends nothing.

        Raises:
            ValueError: what :meth:`step` refuses.
        """
        found = current_autocast(self.device.type)
        if found not in (None, self.autocast):
            raise ValueError(
                f"the step runs under autocast {found} but the pipeline was built for "
                f"{self.autocast or 'none'}: pass autocast={found!r} to DistributedPipeline"
            )
        layout, batch = self.layout, self.batch_size
        args: tuple[Tensor, ...] = ()
        if self.is_first:
            flat = take_shard(self._model.flatten(inputs), layout, batch, "inputs")
            tensors = batch_tensors(flat, batch, self.device, "inputs")
            check_like_sample(tensors, self._model.sample, "inputs")
            args = self._padding.pad(tensors)
        kwargs: dict[str, Any] = dict(self._step_extra)
        if self.is_last:
            if isinstance(target, (tuple, list)):
                raise ValueError("target must be a single tensor")
            target = take_shard(target, layout, batch, "a target")
            target = batch_tensors(target, batch, self.device, "a target")[0]
            kwargs["target"] = self._padding.pad_target(target)
        return args, kwargs

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the original model."""
        return [(self._original[k], p) for k, p in self.module.named_parameters()]

    def state_dict(self) -> OrderedDict[str, Tensor]:
        """This rank's part of the original model's ``state_dict`` (its keys): what its
        stages hold of it, without the constants a trace lifted out of the code and the
        model's non-persistent buffers, which the model's ``state_dict`` leaves out too.
        With ``zero`` 2 or 3 the values are gathered whole over the replicas: a collective
        of the stage's replicas then."""
        names = {name for _, name in self._keys}
        state: OrderedDict[str, Tensor] = OrderedDict()
        for key, value in self.module.state_dict().items():
            name = self._original.get(key, key)
            if name in names:
                state.setdefault(name, whole(value) if self.zero >= 2 else value)
        return state

    def gather_state_dict(self, dst: int = 0) -> OrderedDict[str, Tensor] | None:
        """The whole model's ``state_dict`` (on the CPU) on rank ``dst``; ``None`` elsewhere.

        A collective: call it on every rank. The keys are the original model's; the
        values are replica 0's stages' (the replicas are kept identical), a tensor-parallel
        stage's shards gathered whole.
        """
        first = self.replica_index == 0
        tp_whole = full_state if self._tp is not None else None
        state = []
        if self.zero >= 2:  # every replica takes part in gathering the shards
            state = stage_states(self.module, self.stage_indices, self._original, whole)
            state = state if first else []
        elif first:
            state = stage_states(self.module, self.stage_indices, self._original, tp_whole)
        if self.tensor_index:  # the stage's first tensor rank sends it
            state = []
        if first and self._unheld and not self.tensor_index:  # tensors no stage holds
            own = OrderedDict((k, t.detach().cpu()) for k, t in self._unheld.items())
            state.append((-1 - self.stage_index, own))  # apart from the stages' indices
        world = self.num_stages * self.data_parallel * self.tensor_parallel
        parts: list[Any] | None = [None] * world if self.rank == dst else None
        target = dist.get_global_rank(self.group or dist.group.WORLD, dst)  # type: ignore[arg-type]
        what, gather = "gather the state", dist.gather_object
        collective(self.rank, what, gather, state, parts, dst=target, group=self.group)
        if parts is None:
            return None
        # In stage order, so that the keys come in the original model's order (only replica
        # 0's first tensor ranks sent stages).
        pairs = [pair for part in parts for pair in part]
        everything = sorted(pairs, key=lambda pair: pair[0])
        stages = [pair for pair in everything if pair[0] >= 0]
        unheld = [state for index, state in everything if index < 0]
        return self._plain_state(stages, unheld)

    def _plain_state(
        self,
        stages: list[tuple[int, OrderedDict[str, Tensor]]],
        unheld: list[OrderedDict[str, Tensor]],
    ) -> OrderedDict[str, Tensor]:
        """The stages' states as the plain model's ``state_dict``: its keys, one entry each.

        A tensor of several stages comes from each (its copies are equal): the first is
        kept. Every key of a tied tensor (``lm_head.weight`` as well as
        ``transformer.wte.weight``) gets it, in the plain model's order. What the stages
        hold that the model's ``state_dict`` does not (constants a trace lifted out of the
        code, non-persistent buffers) is left out; a tensor of the model no stage holds (no
        unit reads it) comes from ``unheld``, the ranks' own.

        Raises:
            RuntimeError: a key of the model that neither a stage nor a rank holds.
        """
        names = {name for _, name in self._keys}
        seen: set[str] = set()
        parts = []
        for _, state in stages:
            kept = ((k, v) for k, v in state.items() if k in names and k not in seen)
            parts.append(OrderedDict(kept))
            seen.update(k for k in state if k in self._shared)
        merged = merge_state_dicts(parts)
        for state in unheld:
            for name, value in state.items():
                merged.setdefault(name, value)
        missing = [key for key, name in self._keys if name not in merged]
        if missing:
            raise RuntimeError(
                f"no rank holds a value of {', '.join(missing[:3])} of the model's state_dict"
            )
        return OrderedDict((key, merged[name]) for key, name in self._keys)

    def __repr__(self) -> str:
        # The plan's names are the modules' dotted ones (the stage modules' keys cannot hold dots).
        names = [name for i in self.stage_indices for name in self.plan.stages[i].layers]
        v = self.virtual_stages
        virtual = f", virtual_stages={v} {self.stage_indices}" if v > 1 else ""
        modes = {self.plan.stage_checkpoints[i] for i in self.stage_indices} - {"never"}
        checkpoint = f", checkpoint={'/'.join(sorted(modes))}" if modes else ""
        return (
            f"DistributedPipeline(stage {self.stage_index}/{self.num_stages}{virtual}, replica "
            f"{self.replica_index}/{self.data_parallel}, layers [{', '.join(names)}], "
            f"{self.schedule_name}, chunks={self.chunks}{checkpoint}, device={self.device})"
        )
