"""Tensor parallelism inside a stage: a Hugging Face style plan applied to traced units as DTensors.

A stage's layers are traced units (fx graphs calling ``linear``/``embedding`` on the
parameters of plain holder modules), not the model's ``nn.Linear`` modules, so
``parallelize_module`` finds nothing to hook in them, and the graphs' ``view``/``reshape``
calls hold the global shapes. So the stage runs on DTensors at global shapes:

* the plan is read by graph's reader (:func:`autopipe.graph.check_tp_plan`, its style list,
  and :func:`autopipe.graph.module_styles`, its matching rule), the one the shard counting
  uses, so the runner shards what the planner priced; key/value projections whose heads
  the degree cannot split are replicated, as Megatron replicates them;
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

from autopipe.graph import check_tp_plan, model_tp_plan, module_styles

__all__: list[str] = []  # internal to the distributed runner

# The plan's styles (graph's list, Hugging Face's names) this runner places, by the torch
# style whose placements they use. Their input/output layouts do not matter here: DTensor
# computes every op at global shapes, so a gathered or local output needs nothing more.
COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "local_colwise")
ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise", "local_rowwise")
REPLICATED = ("replicate", "gather", "sequence_parallel")
PLACED = (*COLWISE, *ROWWISE, *REPLICATED)

# The projections whose outputs hold the key/value heads (Hugging Face's names, fused or not).
KV_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "query_key_value")


def plan_problem(plan: Any, tensor_parallel: int) -> str | None:
    """What is wrong with a tensor-parallel plan for degree ``tensor_parallel``, or ``None``."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int):
        return f"tensor_parallel must be a positive integer, got {tensor_parallel!r}"
    if tensor_parallel < 1:
        return f"tensor_parallel must be a positive integer, got {tensor_parallel!r}"
    if plan is None:
        return None
    try:
        checked = check_tp_plan(plan)
    except ValueError as exc:
        return str(exc)
    for name, style in checked.items():
        if style not in PLACED:
            return (
                f"the distributed runner cannot place the tensor-parallel style {style!r} of "
                f"{name!r}; use one of {', '.join(PLACED)}"
            )
    return None


def _divisors(count: int) -> str:
    return ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)


def placed_styles(
    model: nn.Module, plan: Mapping[str, str], tensor_parallel: int
) -> dict[str, str]:
    """Each styled module of ``model`` (:func:`autopipe.graph.module_styles`), the
    key/value projections replicated when ``tensor_parallel`` does not divide the model's
    key/value heads: each rank then computes every key/value head (Megatron's rule, which
    the planner prices) while the query heads stay split."""
    styles = module_styles(model, plan)
    heads = getattr(getattr(model, "config", None), "num_key_value_heads", None)
    if isinstance(heads, int) and heads % tensor_parallel:
        for name, style in styles.items():
            if name.rpartition(".")[2] in KV_PROJECTIONS and style in COLWISE:
                styles[name] = "replicate"
    return styles


def heads_problem(model: nn.Module, plan: Mapping[str, str], tensor_parallel: int) -> str | None:
    """Why the model's query heads cannot be split ``tensor_parallel`` ways, or ``None``
    (key/value heads that cannot be split are replicated: :func:`placed_styles`)."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if not isinstance(heads, int) or not heads % tensor_parallel:
        return None
    styles = module_styles(model, plan)
    query = next((n for n, s in styles.items() if n.endswith("q_proj") and s in COLWISE), None)
    where = query or "the attention"
    return (
        f"{where} has num_attention_heads={heads}, which tensor_parallel={tensor_parallel} "
        f"cannot split into whole heads per rank; use a degree dividing {heads} "
        f"({_divisors(heads)})"
    )


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
        styles: each planned module name with its style (:func:`placed_styles`).
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
    problem = plan_problem(plan, tensor_parallel)
    if problem:
        return problem
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
    return heads_problem(model, plan, tensor_parallel)
