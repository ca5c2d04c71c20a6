"""Runs an autopipe plan over processes, K stages times D replicas, on torch pipelining."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.distributed.padding import MicroBatchPadding
from autopipe.distributed.prepared import original_names, prepare_model
from autopipe.distributed.replicas import (
    ReplicaSync,
    check_layout,
    data_parallel_problem,
    make_layout,
    replica_sample,
    resolve_data_parallel,
    take_shard,
)
from autopipe.distributed.setup import (
    LossRecorder,
    agree,
    agree_on_step,
    batch_tensors,
    check_arguments,
    check_like_sample,
    check_sizes,
    collective,
    default_device,
    fingerprint_settings,
    init_distributed,
    setup_on_rank0,
    share_setup,
)
from autopipe.distributed.stage import checkpoint_problem, fingerprint, merge_state_dicts
from autopipe.distributed.virtual import (
    SCHEDULES,
    RankStages,
    build_stages,
    make_schedule,
    stage_indices,
    stage_states,
    virtual_problem,
)
from autopipe.microbatching.batchnorm import resolve_deferred
from autopipe.microbatching.batchnorm_units import defer_layers
from autopipe.planning.plans import Plan
from profiler.precision import autocast_pass, check_autocast, current_autocast

__all__ = ["SCHEDULES", "DistributedPipeline", "init_distributed", "merge_state_dicts"]


class DistributedPipeline:
    """This rank's stage of a planned pipeline, trained with a torch pipelining schedule.

    Construct it on every rank of an initialised process group with the same arguments.
    The group's K·D ranks run D replicas of a K-stage pipeline: ranks ``r*K .. r*K+K-1``
    are replica r's stages (:attr:`stage_index` = rank % K, :attr:`replica_index` =
    rank // K); with D = 1 (the default) every rank is one stage. Rank 0 profiles the
    model (unless ``plan`` or ``profile`` is given), plans the split for the schedule's
    memory model, measures the tensors crossing every stage boundary on one micro-batch,
    and broadcasts plan and shapes; every rank then keeps its slice of the model as
    :attr:`module`, on :attr:`device`, under the original parameter names, so an ordinary
    optimizer over ``module.parameters()`` trains it.

    With ``virtual_stages=v`` > 1 the K ranks of a pipeline run K·v interleaved stages,
    :attr:`stage_indices` on this rank, all held by :attr:`module` (see
    :mod:`autopipe.distributed.virtual`); the plan balances the K·v stages and predicts the
    interleaved schedule's step time and memory (:mod:`autopipe.planning.interleaving`).

    Before anything else the ranks exchange a fingerprint of their arguments (layer and
    parameter names and shapes, chunks, schedule, sample shapes, D, v, the given plan): any
    difference, an invalid argument on any rank, a group size that is not a multiple of D,
    or a plan made for another stage count or D is raised as ``ValueError`` on every rank.
    Waits on other ranks are bounded by the process group's timeout (see
    :func:`init_distributed`).

    Any other model is traced and cut into units by :mod:`autopipe.gpipe.wrap` (a unit sends
    every tensor live across its cut); its stage keeps the units' own names, while
    :meth:`named_parameters`, :meth:`state_dict` and :meth:`gather_state_dict` use the
    original model's.

    Replicas (D > 1, see :class:`autopipe.distributed.replicas.ReplicaSync`) start from replica 0's
    state; each step's gradients and floating-point buffers (BatchNorm statistics) are
    averaged over a stage's replicas, so they stay identical. With D > 1 the group must
    span the job (``new_group`` makes the sub-groups).

    Args:
        model: an ``nn.Sequential`` (or a model to auto-wrap); its layers are shared with
            the stages, and this rank's layers are moved to ``device``.
        sample: one mini-batch of inputs, the model's positional inputs as
            ``model(*sample)`` takes them (a tensor is one input; an ``nn.Sequential``
            takes one: ``x`` or ``(x,)``, or ``((a, b),)`` for a first layer that takes a
            tuple), as later passed to :meth:`step`, of at least ``chunks`` rows. A batch
            that is not a multiple of ``chunks`` is split as by ``tensor_split`` (sizes
            ⌈N/M⌉ and ⌊N/M⌋) and the smaller micro-batches are padded to the larger size
            for torch's stages and cut before the loss (:mod:`autopipe.distributed.padding`; not
            for models with BatchNorm). With D > 1 it is the global mini-batch (D·b
            rows, b per replica) when its batch size is a multiple of ``D·chunks``, else
            one replica's shard (b rows); a given plan whose ``batch_size`` is D times
            the sample's marks it as a shard in any case.
        loss_fn: ``loss_fn(output, target)`` for one micro-batch, ``output`` as the model
            returns it; the mini-batch loss and gradients are those of the mean over the
            micro-batches.
        chunks: micro-batches per mini-batch (M).
        schedule: ``1f1b`` (default; needs ``chunks >= K``, or with v > 1 chunks a
            multiple of ``max(1, chunks // K)``) or ``gpipe``.
        plan: a plan to use instead of planning; its stage count must be K·v (K: the
            group's size divided by D).
        group: the process group (default: the world).
        device: this rank's device (default: the current CUDA device under ``nccl``, else
            the CPU).
        profile: a profile to plan from instead of profiling on rank 0.
        memory: device capacity for planning (bytes or ``"16GiB"``; one or per stage).
        plan_options: more keyword arguments for :func:`autopipe.plan` (``strategy``,
            ``optimizer``, ``bandwidth``).
        data_parallel: pipeline replicas (D; default: the plan's ``data_parallel`` when a
            plan is given, else 1). Rank 0 plans for D replicas and the global batch.
        virtual_stages: stages per rank (v; default 1). With v > 1 rank 0 plans K·v
            stages (``plan(..., virtual_stages=v)``) and the interleaved schedules run
            them; a given plan has K·v stages (made with ``virtual_stages=v`` or not).
        autocast: ``bfloat16`` or ``float16`` to train in mixed precision: rank 0 profiles
            under ``torch.autocast`` (a given profile must have been made so), the stage
            boundaries get the dtypes autocast produces, and :meth:`step` runs under it.
            The stages exchange tensors of the dtypes measured here, so a step under the
            caller's own autocast needs this set to the same dtype.
        checkpoint: re-materialization, as the plan models it: ``never`` (default; every
            stage keeps its micro-batches' activations), ``always`` (a stage keeps only
            each micro-batch's input and runs its forward again in backward),
            ``except_last`` (all but the last micro-batch) or ``auto`` (each stage only
            if it does not fit otherwise). A given plan's own modes are used instead.
        deferred_batch_norm: update each BatchNorm's running statistics once per step
            from all the inputs it saw: the whole mini-batch, with replicas the global one
            (their counts, means and squared deviations merged exactly), as the plain
            model does; each micro-batch is still normalized with its own statistics.
            ``None`` (default): on when the model has a BatchNorm with running statistics
            and a step splits the batch; ``False`` updates them once per micro-batch (and
            averages them over replicas), with a warning. The model's own modules are not
            converted: the stages run deferred views of them.

    Raises:
        ValueError: invalid or mismatched arguments, or no plan fits (on every rank).
        RuntimeError: no process group, or another rank failed during setup.
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Tensor | tuple[Tensor, ...],
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        chunks: int,
        schedule: str = "1f1b",
        plan: Plan | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        profile: Any = None,
        memory: Any = None,
        plan_options: Mapping[str, Any] | None = None,
        data_parallel: int | None = None,
        virtual_stages: int = 1,
        autocast: str | None = None,
        checkpoint: str = "never",
        deferred_batch_norm: bool | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedPipeline needs an initialised process group: call "
                "autopipe.distributed.init_distributed() (or init_process_group) first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        # Before K is known (it needs D agreed) the rank stands for the stage in messages.
        self.stage_index, self.num_stages, self.replica_index = self.rank, world, 0
        self.data_parallel: int = resolve_data_parallel(data_parallel, plan, world)
        self.device = torch.device(device) if device is not None else default_device(group)
        self.chunks = chunks
        self.schedule_name = schedule
        self.virtual_stages = virtual_stages
        self.autocast = autocast
        self.stage_indices: list[int] = []
        self.batch_size = 0
        self._steps = 0
        self._broken = False
        self._deferred, warning = False, None
        # Exchange what must agree before anything can hang on a disagreement; a rank with
        # bad arguments still joins, so that every rank raises instead of waiting.
        try:
            self._model = prepare_model(model, sample)
            layers = OrderedDict(self._model.sequential.named_children())
            sample = self._model.sample
            problem = check_arguments(layers, sample, chunks, schedule, loss_fn, plan)
            problem = problem or data_parallel_problem(self.data_parallel)
            problem = problem or virtual_problem(virtual_stages)
            problem = problem or checkpoint_problem(checkpoint)
            check_autocast(autocast)
            if not problem:
                self._deferred, warning = resolve_deferred(
                    deferred_batch_norm, model, chunks, self.data_parallel
                )
            if self._deferred:  # the stages run these; the model is left as it is
                layers = defer_layers(layers, model)
        except ValueError as exc:
            layers, problem = OrderedDict(), str(exc)
        settings = {} if problem else fingerprint_settings(sample, chunks, schedule, plan, profile)
        settings["data_parallel"] = self.data_parallel
        settings["virtual_stages"] = virtual_stages
        settings["autocast"] = autocast
        settings["checkpoint"] = checkpoint
        settings["deferred_batch_norm"] = self._deferred
        agree(self.rank, world, problem, fingerprint(layers, **settings) if not problem else {})
        if warning:
            warnings.warn(warning, stacklevel=2)
        d, v = self.data_parallel, virtual_stages
        k = check_layout(world, d, data_parallel, plan)
        check_sizes(k, len(layers), plan, schedule, chunks, data_parallel=d, virtual_stages=v)
        # Rank 0 profiles one replica's rows and plans D replicas of the global batch.
        self.batch_size, sample = replica_sample(sample, d, chunks, plan)
        self._padding = MicroBatchPadding(self.batch_size, chunks)
        self.layout = layout = make_layout(group, d, self.device)
        self.stage_index, self.num_stages, self.replica_index = layout.stage, k, layout.replica
        replicas = {"data_parallel": d, "batch": d * self.batch_size} if d > 1 else {}
        options = {"chunks": chunks, "schedule": schedule, "memory": memory, **replicas}
        options["checkpoint"] = checkpoint
        if v > 1:
            options["virtual_stages"] = v
        if self.batch_size % chunks:  # uneven micro-batches run padded to the largest
            options["padded"] = True
        options.update(plan_options or {})
        sequential = self._model.sequential

        def make() -> tuple[Any, BaseException | None]:
            return setup_on_rank0(
                sequential, sample, k * v, self.device, plan, profile, options, autocast
            )

        self.plan, specs = share_setup(self.rank, group, self.device, make)
        self._build(layers, sample, specs, loss_fn, model)

    def _build(
        self,
        layers: OrderedDict[str, nn.Module],
        sample: Any,
        specs: list[Any],
        loss_fn: Any,
        model: nn.Module,
    ) -> None:
        k, micro = self.num_stages, self._padding.rows
        self.stage_indices = stage_indices(self.stage_index, k, self.virtual_stages)
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
        self.module.to(self.device)
        self._sync = ReplicaSync(self.module, self.layout)
        collective(self.rank, "receive replica 0's state", self._sync.broadcast_state)
        if self._model.wrapped:  # the loss sees the model's outputs, not the flat tensors
            rebuild, inner = self._model.rebuild, loss_fn
            loss_fn = lambda out, tgt: inner(rebuild(out, self.module.training), tgt)  # noqa: E731
        self._loss = LossRecorder(self._padding.loss(loss_fn), self.chunks)
        total, group = k * self.virtual_stages, self.layout.pipeline
        self.schedule, self.stages, self._step_extra = make_schedule(
            self.schedule_name, stages, total, self.device, group, self.chunks, self._loss
        )
        self.stage = self.stages[0]

    # With virtual stages, position 0 holds stage 0 and position K−1 the last stage, K·v−1.
    @classmethod
    def from_search(
        cls,
        model: nn.Module,
        sample: Tensor | tuple[Tensor, ...],
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        search_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> DistributedPipeline:
        """A pipeline in the configuration :func:`autopipe.search` ranks first; a collective.

        Rank 0 profiles the model and searches the pipeline depth K and data-parallel width
        D with K·D the group's size, the micro-batches, checkpointing, schedule and (with
        ``virtual_stages`` in ``search_options``) stages per device, among configurations
        that split the batch evenly (:func:`autopipe.distributed.search.search_plan`); every rank
        then builds the pipeline from that plan.

        Args:
            model: as for the constructor.
            sample: the global mini-batch a step takes.
            loss_fn: as for the constructor.
            group: the process group (default: the world).
            device: this rank's device.
            search_options: for :func:`autopipe.distributed.search.search_plan` (``memory``,
                ``schedules``, ``checkpoints``, ``virtual_stages``, ``calibrate``,
                ``profile``, ``optimizer``).
            **kwargs: more constructor arguments (``autocast``, ``plan_options`` are not
                searched).

        Raises:
            ValueError: no configuration of the group's size fits (on every rank).
        """
        from autopipe.distributed.search import search_plan

        options = dict(search_options or {})
        plan = search_plan(model, sample, group=group, device=device, **options)
        return cls(
            model,
            sample,
            loss_fn=loss_fn,
            chunks=plan.chunks,
            schedule=plan.schedule,
            plan=plan,
            group=group,
            device=device,
            data_parallel=plan.data_parallel,
            virtual_stages=plan.virtual_stages,
            **kwargs,
        )

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (and reads the inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (reads the targets, returns the loss)."""
        return self.stage_index == self.num_stages - 1

    def step(self, inputs: Any = None, target: Any = None) -> Tensor | None:
        """Runs forward and backward of one mini-batch through the pipeline.

        Call it on every rank with the same mini-batch; only the first stage reads
        ``inputs`` (the model's positional inputs, as the sample) and only the last reads
        ``target`` (others may pass ``None``). Gradients
        are added to the ``.grad`` of :attr:`module`'s parameters, as ``backward`` would.
        With D replicas, each argument is either the global mini-batch (D·b rows, of which
        replica r takes rows ``[r*b, (r+1)*b)``) or this replica's shard (b rows, as a
        ``DistributedSampler`` gives); the gradients then are those of the mean loss over
        all D·M micro-batches.

        Returns:
            On the last stage's ranks, the mean of ``loss_fn`` over the micro-batches of
            all replicas (detached); ``None`` on the other ranks.

        Raises:
            ValueError: a mini-batch of another size than the sample's (or, with replicas,
                than the global and the per-replica batch), inputs of other shapes past
                dim 0 or dtypes than the sample's, or a step under another autocast than
                the pipeline's (its stages would exchange tensors of the wrong dtype). The
                ranks agree on it before the step sends anything: a step refused on one
                rank is refused on every rank (the message names the rank), and the
                pipeline can run the next one.
            RuntimeError: a step failed on this or another rank before (the pipeline's
                ranks are out of step then), or the process group timed out.
        """
        if self._broken:
            raise RuntimeError("an earlier step failed; this pipeline cannot run again")
        problem: str | None = None
        failure: Exception | None = None
        try:
            args, kwargs = self._arguments(inputs, target)
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
        layout = self.layout
        self._loss.values.clear()
        try:
            with self._sync.step(), autocast_pass(self.device.type, self.autocast):
                self.schedule.step(*args, **kwargs)
            loss = self._sync.mean_loss(self._loss.mean()) if self.is_last else None
        except BaseException as exc:
            self._broken = True
            if hasattr(exc, "add_note"):
                replica = f", replica {layout.replica}" if layout.data_parallel > 1 else ""
                exc.add_note(
                    f"autopipe: step {self._steps} failed on rank {self.rank} (stage "
                    f"{self.stage_index} of {self.num_stages}{replica}); if another rank "
                    "failed first, its log has the cause"
                )
            raise
        self._steps += 1
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
        """This rank's part of the original model's ``state_dict`` (its keys)."""
        state: OrderedDict[str, Tensor] = OrderedDict()
        for key, value in self.module.state_dict().items():
            state.setdefault(self._original.get(key, key), value)
        return state

    def gather_state_dict(self, dst: int = 0) -> OrderedDict[str, Tensor] | None:
        """The whole model's ``state_dict`` (on the CPU) on rank ``dst``; ``None`` elsewhere.

        A collective: call it on every rank. The keys are the original model's; the
        values are replica 0's stages' (the replicas are kept identical).
        """
        first = self.replica_index == 0
        state = stage_states(self.module, self.stage_indices, self._original) if first else []
        world = self.num_stages * self.data_parallel
        parts: list[Any] | None = [None] * world if self.rank == dst else None
        target = dist.get_global_rank(self.group or dist.group.WORLD, dst)  # type: ignore[arg-type]
        what, gather = "gather the state", dist.gather_object
        collective(self.rank, what, gather, state, parts, dst=target, group=self.group)
        if parts is None:
            return None
        # In stage order, so that the keys come in the original model's order.
        pairs = [pair for part in parts[: self.num_stages] for pair in part]
        stages = sorted(pairs, key=lambda pair: pair[0])
        return merge_state_dicts(state for _, state in stages)

    def __repr__(self) -> str:
        module = self.module
        names = module.layer_names() if isinstance(module, RankStages) else list(module._modules)
        v = self.virtual_stages
        virtual = f", virtual_stages={v} {self.stage_indices}" if v > 1 else ""
        modes = {self.plan.stage_checkpoints[i] for i in self.stage_indices} - {"never"}
        checkpoint = f", checkpoint={'/'.join(sorted(modes))}" if modes else ""
        return (
            f"DistributedPipeline(stage {self.stage_index}/{self.num_stages}{virtual}, replica "
            f"{self.replica_index}/{self.data_parallel}, layers [{', '.join(names)}], "
            f"{self.schedule_name}, chunks={self.chunks}{checkpoint}, device={self.device})"
        )
