"""Per-rank pieces of a distributed pipeline: stage modules, shapes, fingerprints, losses."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from autopipe.microbatching import BufferSnapshot, checkpointing, recomputing
from autopipe.planning import CHECKPOINT_MODES, FIXED_CHECKPOINT_MODES, Plan
from profiler import autocast_pass

__all__: list[str] = []

# (shape, dtype, requires_grad) of one tensor crossing a stage boundary; picklable, so it
# can be broadcast from the rank that measured it.
TensorSpec = tuple[tuple[int, ...], torch.dtype, bool]


# A stage's modes: the plan's fixed ones, or ``units``: the layers a plan lists for the
# stage (``StagePlan.recompute_units``) re-computed, each on every micro-batch.
STAGE_MODES = (*FIXED_CHECKPOINT_MODES, "units")
# The V schedules, whose backward torch splits: the input's gradient
# (stage_backward_input), then the weights' in later autograd calls (stage_backward_weight,
# one per parameter group). torch.utils.checkpoint re-computes a checkpointed forward in
# every autograd call that needs it and keeps nothing between calls, so a re-computing
# stage runs its forward again for the input's gradient and for each group of weights:
# not the one re-computation (and the activations kept from I to W) a plan prices. Such
# plans are for export (torchtitan, DeepSpeed, Megatron-LM). (``zb`` runs re-computed
# units so, as it always has: they train exactly, at that extra cost.)
_SPLIT = ("zbv", "dualpipev")


def split_backward_problem(schedule: str, checkpoint: str) -> str | None:
    """Why the runner does not re-compute under ``schedule``'s split backward, or ``None``."""
    if schedule not in _SPLIT or checkpoint == "never":
        return None
    return (
        f"{schedule} splits each backward, and torch re-runs a checkpointed forward in the "
        "input's and again in the weights' part (not once, as the plan prices): the runner "
        f"runs {schedule} with checkpoint='never' only, not {checkpoint!r} (plans that "
        "re-compute under it are for export)"
    )


def checkpoint_problem(mode: str) -> str | None:
    """Why ``mode`` is not a checkpoint mode the distributed runner takes, or ``None``."""
    if mode in CHECKPOINT_MODES:
        return None
    if mode == "units":
        return (
            "checkpoint='units' is a stage's mode that a plan chooses, with the units it "
            "lists: pass checkpoint='auto' with memory=, or plan= a plan made so"
        )
    return f"unknown checkpoint mode {mode!r}: choose {', '.join(CHECKPOINT_MODES)}"


def units_problem(checkpoint: str, units: Sequence[int], start: int, stop: int) -> str | None:
    """What is wrong with the ``units`` a stage of layers ``[start, stop)`` re-computes under
    its ``checkpoint`` mode, or ``None``: ``units`` lists distinct layers of the stage,
    ascending, exactly when the mode is ``units``."""
    if checkpoint not in STAGE_MODES:
        modes = ", ".join(STAGE_MODES)
        return f"unknown checkpoint mode {checkpoint!r} for a stage: choose {modes}"
    listed = list(units)
    if (checkpoint == "units") != bool(listed):
        return (
            f"checkpoint {checkpoint!r} with re-computed units {listed}: a stage lists the "
            "units it re-computes exactly when its checkpoint is 'units'"
        )
    valid = all(
        isinstance(u, int) and not isinstance(u, bool) and start <= u < stop for u in listed
    )
    if not valid or listed != sorted(set(listed)):
        return (
            f"re-computed units {listed} must be distinct layers of the stage ({start} to "
            f"{stop - 1}), ascending"
        )
    return None


def plan_checkpoint_problem(plan: Plan | None, schedule: str) -> str | None:
    """What keeps the distributed runner from running a given plan's checkpoint modes under
    ``schedule``, or ``None``: every stage's mode is one a stage runs, a ``units`` stage
    lists layers of its own (``recompute_units``, ascending), and no stage re-computes
    under a V schedule (``zbv``, ``dualpipev``: :func:`split_backward_problem`)."""
    if plan is None:
        return None
    remake = "re-create the plan with autopipe.plan (checkpoint='auto' chooses per stage)"
    for stage, mode in zip(plan.stages, plan.stage_checkpoints):
        units = stage.recompute_units
        if not isinstance(units, list):
            return f"stage {stage.index} of the plan lists recompute_units {units!r}; {remake}"
        problem = units_problem(mode, units, stage.start, stage.stop)
        if problem is not None:
            return f"stage {stage.index} of the plan: {problem}; {remake}"
        split = split_backward_problem(schedule, mode)
        if split is not None:
            return f"stage {stage.index} of the plan: {split}; run it with schedule='1f1b'"
    return None


class StageModule(nn.Module):
    """Consecutive layers of an ``nn.Sequential``, registered under their original names.

    Runs them exactly as ``nn.Sequential`` does (each layer gets the previous layer's output
    as its single argument), so a stage computes the same values as the slice of the
    original model, and ``state_dict()`` keys (``"3.weight"``, ...) match the original's.

    Args:
        layers: ``(name, layer)`` pairs in execution order.
        tuple_input: the stage's input is a tuple (the previous layer returned one); the
            pipeline delivers its tensors as separate arguments, which are packed back.
        checkpoint: ``never``, ``always``, ``except_last`` or ``units``: re-materialization
            of the stage's micro-batches while training (GPipe's): a checkpointed
            micro-batch keeps only its input, and its forward runs again in backward, with
            the same random numbers and without updating batch-norm statistics a second
            time. With ``units`` only the layers at the positions ``units`` lists are
            re-computed so, each on its own and on every micro-batch.
        chunks: micro-batches per step.
        spared: with ``except_last``, the micro-batch not checkpointed: the one whose
            backward the schedule runs first (torch's schedules go backward in order, so
            the first; looped BFS in reverse: the last).
        units: with ``units``, the positions (0-based, among ``layers``, ascending) of the
            layers re-computed; else empty.

    Attributes:
        checkpointed: the forwards run under activation checkpointing so far: of whole
            micro-batches, or with ``units`` of single layers.

    Raises:
        ValueError: an unknown mode, or ``units`` that do not fit it or the layers.
    """

    def __init__(
        self,
        layers: Iterable[tuple[str, nn.Module]],
        *,
        tuple_input: bool = False,
        checkpoint: str = "never",
        chunks: int = 1,
        spared: int | None = None,
        units: Sequence[int] = (),
    ):
        super().__init__()
        for name, layer in layers:
            self.add_module(name, layer)
        problem = units_problem(checkpoint, units, 0, len(self._modules))
        if problem is not None:
            raise ValueError(problem)
        self.tuple_input = tuple_input
        self.checkpoint = checkpoint
        self.chunks = chunks
        self.spared = chunks - 1 if spared is None else spared
        self.units: tuple[int, ...] = tuple(units)
        # Forwards run in micro-batch order on every stage: the count gives the index.
        self.forwards = 0
        self.checkpointed = 0

    def _run(self, *args: Any) -> Any:
        value: Any = args if self.tuple_input else args[0]
        for layer in self.children():
            value = layer(value)
        return value

    def _run_units(self, *args: Any) -> Any:
        """The layers in order, those of :attr:`units` each under activation checkpointing."""
        value: Any = args if self.tuple_input else args[0]
        recomputed = set(self.units)
        for position, (name, layer) in enumerate(self._modules.items()):
            assert layer is not None
            if position not in recomputed:
                value = layer(value)
                continue
            self.checkpointed += 1
            before = _versions(value)
            output = torch.utils.checkpoint.checkpoint(
                _Replay(layer, layer), value, use_reentrant=False, preserve_rng_state=True
            )
            if _versions(value) != before:
                # Its re-computation would start from the modified input: wrong values, silently.
                raise RuntimeError(
                    f"layer {name!r}, which the plan re-computes, modifies its input in "
                    "place, so its re-computation would not see the input it had: make the "
                    "operation out of place, or plan without re-computing that layer"
                )
            value = output
        return value

    def forward(self, *args: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()) or self.checkpoint == "never":
            return self._run(*args)
        if self.checkpoint == "units":  # every micro-batch alike: no count needed
            return self._run_units(*args)
        micro_batch = self.forwards % self.chunks
        self.forwards += 1
        if self.checkpoint == "except_last" and micro_batch == self.spared:
            return self._run(*args)
        self.checkpointed += 1
        return torch.utils.checkpoint.checkpoint(
            _Replay(self, self._run), *args, use_reentrant=False, preserve_rng_state=True
        )


class _Replay:
    """A checkpointed forward for ``torch.utils.checkpoint``: ``run`` over the layers of
    ``owner`` (a whole stage, or one unit of it). The first call computes; a later one (the
    re-computation in backward) runs on copies of the buffers the owner's traced units may
    write and of its other modules' small buffers, as the first call found them
    (:class:`~autopipe.microbatching.BufferSnapshot`), and of the larger ones as they are:
    it computes what the first call computed, batch-norm running statistics and counters
    move once, and the live buffers are not modified in place (a micro-batch or unit that was not
    re-computed may have saved them for its backward). It runs marked as a
    re-computation, so deferred batch-norm layers do not count the micro-batch a second
    time."""

    def __init__(self, owner: nn.Module, run: Callable[..., Any]) -> None:
        self.owner, self.run, self.calls = owner, run, 0
        self.buffers: BufferSnapshot | None = None

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            self.buffers = BufferSnapshot(self.owner, small=True)
            with checkpointing():
                return self.run(*args)
        assert self.buffers is not None
        with self.buffers.restored(copy_others=True), recomputing():
            return self.run(*args)


def _versions(value: Any) -> list[int]:
    """The version counters of the tensors in ``value`` (nested tuples, lists, dicts)."""
    if isinstance(value, Tensor):
        return [value._version]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [version for item in value for version in _versions(item)]
    return []


def _as_tensors(value: Any, what: str) -> tuple[Tensor, ...]:
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return tuple(value)
    raise TypeError(f"{what} must be a tensor or a non-empty tuple of tensors, got {value!r:.80}")


def _spec(tensor: Tensor) -> TensorSpec:
    return (tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad))


def _leaf(tensor: Tensor, device: torch.device) -> Tensor:
    # A fresh leaf keeps each layer's graph separate, so only one layer's graph is alive.
    return tensor.detach().to(device).requires_grad_(tensor.requires_grad)


def layer_output_specs(
    layers: Sequence[nn.Module],
    micro_batch: Tensor | tuple[Tensor, ...],
    autocast: str | None = None,
) -> list[tuple[tuple[TensorSpec, ...], bool]]:
    """The shape, dtype and ``requires_grad`` of every layer's output on one micro-batch.

    Runs the layers one by one with gradients enabled (``requires_grad`` of a boundary
    decides whether the pipeline sends a gradient back across it), each where its
    parameters live. Layers with buffers run as copies so that, e.g., batch-norm running
    statistics are not updated, and the RNG state is restored afterwards. Under
    ``autocast`` (``bfloat16`` or ``float16``) the layers run in it, so the boundaries have
    the dtypes the pipeline will send.

    Returns:
        Per layer: the specs of its output tensors, and whether the output is a tuple.
    """
    cuda = sorted(
        {p.device.index or 0 for layer in layers for p in layer.parameters() if p.is_cuda}
    )
    value: Any = micro_batch
    specs: list[tuple[tuple[TensorSpec, ...], bool]] = []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        for index, layer in enumerate(layers):
            state = [*layer.parameters(), *layer.buffers()]
            device = state[0].device if state else _as_tensors(value, "input")[0].device
            runner = copy.deepcopy(layer) if any(True for _ in layer.buffers()) else layer
            if isinstance(value, Tensor):
                value = _leaf(value, device)
            else:
                value = tuple(_leaf(t, device) for t in value)
            with autocast_pass(device.type, autocast):
                output = runner(value)
            tensors = _as_tensors(output, f"the output of layer {index} ({type(layer).__name__})")
            specs.append((tuple(_spec(t) for t in tensors), not isinstance(output, Tensor)))
            value = output
    return specs


def example_tensors(specs: Sequence[TensorSpec], device: torch.device) -> tuple[Tensor, ...]:
    """Uninitialised tensors matching ``specs``, for ``PipelineStage``'s shape metadata."""
    return tuple(
        torch.empty(shape, dtype=dtype, device=device).requires_grad_(grad)
        for shape, dtype, grad in specs
    )


def fingerprint(layers: Mapping[str, nn.Module], **settings: Any) -> dict[str, Any]:
    """What every rank must agree on: the layer names, their state's names and shapes, and
    the given ``settings`` (chunks, schedule, sample shapes, ...)."""
    state = [
        (f"{name}.{key}", tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, layer in layers.items()
        for key, t in [*layer.named_parameters(), *layer.named_buffers()]
    ]
    return {"layers": list(layers), "state": state, **settings}


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}: {x!r} vs {y!r}"
    return f"{len(a)} vs {len(b)} entries"


def compare_fingerprints(prints: Sequence[Mapping[str, Any]]) -> str | None:
    """Describes how the ranks' fingerprints disagree, or ``None`` when they all match.

    Every field is compared with rank 0's; the message names the field, the ranks and the
    first differing entry of list fields.
    """
    problems = []
    for key in prints[0]:
        for rank, other in enumerate(prints[1:], start=1):
            mine, theirs = prints[0][key], other.get(key)
            if mine == theirs:
                continue
            if isinstance(mine, list) and isinstance(theirs, list):
                detail = _first_difference(mine, theirs)
            else:
                detail = f"{mine!r} vs {theirs!r}"
            problems.append(f"{key} differs between rank 0 and rank {rank} ({detail})")
            break
    return "; ".join(problems) or None


def merge_state_dicts(parts: Iterable[Mapping[str, Any]]) -> OrderedDict[str, Any]:
    """Joins the ``state_dict()`` of every stage into the original model's ``state_dict``.

    Stage modules keep the original parameter names, so the stages' keys are disjoint and
    their union loads into the unsplit model (``model.load_state_dict(merged)``).

    Raises:
        ValueError: two parts hold the same key (they were not stages of one pipeline).
    """
    merged: OrderedDict[str, Any] = OrderedDict()
    for index, part in enumerate(parts):
        for key, value in part.items():
            if key in merged:
                raise ValueError(f"key {key!r} of part {index} is already in an earlier part")
            merged[key] = value
    return merged


class LossRecorder:
    """Wraps a per-micro-batch loss for a schedule: returns ``loss / M`` to backpropagate
    (so the gradients are those of the mean over micro-batches) and records ``loss``.

    Args:
        loss_fn: ``loss_fn(output, target)`` of one micro-batch.
        chunks: micro-batches per mini-batch (M).
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Tensor], chunks: int) -> None:
        self.loss_fn = loss_fn
        self.chunks = chunks
        self.values: list[Tensor] = []

    def __call__(self, output: Any, target: Any) -> Tensor:
        loss = self.loss_fn(output, target)
        self.values.append(loss.detach())
        return loss / self.chunks

    def mean(self) -> Tensor:
        """The mean of the last M recorded losses: the mini-batch loss."""
        return torch.stack(self.values[-self.chunks :]).mean()
