"""Tensor parallelism inside a stage: a Hugging Face style plan applied to traced units as DTensors.

A stage's layers are traced units (fx graphs calling ``linear``/``embedding`` on the
parameters of plain holder modules), not the model's ``nn.Linear`` modules, so
``parallelize_module`` finds nothing to hook in them, and the graphs' ``view``/``reshape``
calls hold the global shapes. So the stage runs on DTensors at global shapes:

* each planned parameter is distributed on the tensor mesh by the partition functions of
  torch's own styles (``ColwiseParallel``: weight and bias ``Shard(0)``, an embedding
  ``Shard(1)``; ``RowwiseParallel``: weight ``Shard(1)``, bias ``Replicate()``, an embedding
  ``Shard(0)``), every other parameter ``Replicate()``;
* each unit takes its tensors as replicated DTensors and returns them redistributed to
  ``Replicate()`` as plain tensors, so the pipeline sends full tensors, as before; inside a
  unit DTensor's sharding propagation runs every op, with the collectives its rules choose
  (a row-wise product's partial sum is all-reduced where the next op needs it whole);
* after backward every gradient is redistributed to its parameter's placement: DTensor
  leaves the gradients of replicated parameters fed by sharded products (the norms before
  column-wise layers) and of some sharded ones as partial sums, which one all-reduce over
  the tensor group completes, so an ordinary optimizer sees each rank's true shard.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autopipe.graph import model_tp_plan

__all__: list[str] = []  # internal to the distributed runner

# The plan styles taken (Hugging Face's names) and the torch style whose placements they use.
# Their input/output layouts do not matter here: DTensor computes every op at global shapes.
COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "embedding_colwise")
ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise")
REPLICATED = ("replicate", "replicated_with_grad_allreduce")
STYLES = (*COLWISE, *ROWWISE, *REPLICATED)


def plan_problem(plan: Any, tensor_parallel: int) -> str | None:
    """What is wrong with a tensor-parallel plan for degree ``tensor_parallel``, or ``None``."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int):
        return f"tensor_parallel must be a positive integer, got {tensor_parallel!r}"
    if tensor_parallel < 1:
        return f"tensor_parallel must be a positive integer, got {tensor_parallel!r}"
    if plan is None:
        return None
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) for k in plan):
        return "tp_plan must map module names (with *) to styles, as a model's _tp_plan"
    for name, style in plan.items():
        if style not in STYLES:
            return (
                f"unknown tensor-parallel style {style!r} for {name!r}: choose one of "
                f"{', '.join(STYLES)}"
            )
    return None


def _matches(pattern: str, name: str) -> bool:
    # "*" stands for one dotted component (a layer index), as in Hugging Face's plans.
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names))


def module_styles(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Each module of ``model`` that ``plan`` names, with its style (an exact name before
    a pattern)."""
    styles: dict[str, str] = {}
    for name, _ in model.named_modules():
        if name in plan:
            styles[name] = plan[name]
            continue
        found = [style for pattern, style in plan.items() if _matches(pattern, name)]
        if found:
            styles[name] = found[0]
    return styles


def heads_problem(model: nn.Module, tensor_parallel: int) -> str | None:
    """Why the model's attention heads cannot be split ``tensor_parallel`` ways, or ``None``."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tensor_parallel:
            return (
                f"{field}={heads} is not divisible by tensor_parallel={tensor_parallel}: "
                "each rank must hold whole heads; use a degree that divides it"
            )
    return None


def _partition(style: str, module: nn.Module, holder: nn.Module, mesh: DeviceMesh) -> None:
    """Distributes ``holder``'s parameters as torch's style would those of ``module``
    (the original ``nn.Linear`` or ``nn.Embedding`` the holder's parameters belong to)."""
    if style in REPLICATED:
        _replicate(holder, mesh)
        return
    torch_style = ColwiseParallel() if style in COLWISE else RowwiseParallel()
    if isinstance(module, nn.Embedding):
        torch_style._partition_embedding_fn("", holder, mesh)
    elif isinstance(module, nn.Linear):
        torch_style._partition_linear_fn("", holder, mesh)
    else:
        raise ValueError(
            f"the tensor-parallel style {style!r} applies to nn.Linear and nn.Embedding, "
            f"not {type(module).__name__}; leave it out of tp_plan"
        )


def _replicate(holder: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(holder.named_parameters(recurse=False)):
        placed = distribute_tensor(param.detach(), mesh, [Replicate()])
        holder.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))


def _to_dtensor(value: Any, mesh: DeviceMesh) -> Any:
    if isinstance(value, DTensor):
        return value
    if isinstance(value, Tensor):
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_dtensor(v, mesh) for v in value)
    return value


def _to_local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.redistribute(placements=[Replicate()] * value.device_mesh.ndim).to_local()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_local(v) for v in value)
    return value


def _unit_forward(forward: Any, mesh: DeviceMesh, *args: Any) -> Any:
    # Plain tensors the graph makes (masks, positions) count as replicated.
    with implicit_replication():
        return _to_local(forward(*_to_dtensor(args, mesh)))


class TensorParallel:
    """One rank's part of its stages' layers, sharded over the tensor-parallel ranks.

    Args:
        layers: the stages' layers (units) on this rank, their parameters the model's.
        model: the original model, whose module names the plan uses.
        styles: each planned module name with its style (:func:`module_styles`).
        mesh: the tensor-parallel device mesh (1-D, this rank's group of t ranks).

    Raises:
        ValueError: a style is given to a module that is not ``nn.Linear`` or ``nn.Embedding``.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        model: nn.Module,
        styles: Mapping[str, str],
        mesh: DeviceMesh,
    ) -> None:
        self.mesh = mesh
        owners: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), name)
        modules = dict(model.named_modules())
        placed: dict[int, nn.Parameter] = {}  # a parameter in several graphs is placed once
        for layer in layers:
            for holder in list(layer.modules()):
                own = list(holder.named_parameters(recurse=False))
                if not own:
                    continue
                if all(id(p) in placed for _, p in own):
                    for key, param in own:
                        holder.register_parameter(key, placed[id(param)])
                    continue
                originals = [p for _, p in own]
                owner = owners.get(id(originals[0]), "").rpartition(".")[0]
                style = styles.get(owner)
                if style is None:
                    _replicate(holder, mesh)
                else:
                    _partition(style, modules[owner], holder, mesh)
                for (key, _), original in zip(own, originals):
                    placed[id(original)] = getattr(holder, key)
            # The unit's own forward, run on DTensors; set on the instance so a re-computed
            # (checkpointed) forward goes through it too.
            layer.forward = functools.partial(_unit_forward, layer.forward, mesh)
        self.params: list[Any] = list(placed.values())  # parameters holding DTensors

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one pipeline step: each gradient redistributed to its parameter's
        placement afterwards (an all-reduce over the tensor group where it is partial)."""
        yield
        for param in self.params:
            grad = param.grad
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)


def local(tensor: Tensor) -> Tensor:
    """The rank's own values of ``tensor``: a DTensor's local shard, or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def full_state(value: Tensor) -> Tensor:
    """``value`` whole: a DTensor gathered over the tensor group (a collective: its ranks
    pass the same tensors in the same order), any other tensor as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def tensor_parallel_problem(
    model: nn.Module, tensor_parallel: Any, tp_plan: Any, schedule: str, virtual_stages: int
) -> str | None:
    """What refuses tensor parallelism of degree ``tensor_parallel`` for ``model``, or ``None``.

    Args:
        model: the model (its plan and attention heads).
        tensor_parallel: the degree (t).
        tp_plan: the given plan, or ``None`` for the model's own
            (:func:`autopipe.graph.model_tp_plan`).
        schedule: the pipeline schedule.
        virtual_stages: stages per rank.
    """
    problem = plan_problem(tp_plan, tensor_parallel)
    if problem or tensor_parallel == 1:
        return problem
    plan = (model_tp_plan(model) or {}) if tp_plan is None else tp_plan
    if not module_styles(model, plan):
        return (
            f"tensor_parallel={tensor_parallel} needs a plan naming the model's modules: the "
            "model has no _tp_plan matching them; pass tp_plan={'layers.*.fc': 'colwise', ...}"
        )
    if schedule == "zb" or virtual_stages > 1:
        return (
            "tensor_parallel > 1 runs with one stage per rank under gpipe or 1f1b; "
            "use virtual_stages=1 and schedule='gpipe' or '1f1b'"
        )
    return heads_problem(model, tensor_parallel)
