"""Tracing models whose tensors are (all or partly) on the meta device: no storage, no values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch import Tensor, nn

from profiler import materialize_part, swapped_state

__all__ = ["has_meta_state", "materialize_units", "meta_bytes", "rebind_state", "unused_meta"]

META = torch.device("meta")

# What torch says when code needs the values a meta tensor does not have, and the construct.
_CONSTRUCTS = (
    ("Tensor.item() cannot be called on meta tensors", "Tensor.item() (or a tensor in an if)"),
    ("torch.nonzero()", "torch.nonzero (or indexing with a boolean mask)"),
    ("Cannot copy out of meta tensor", "reading a tensor's values (.tolist(), .cpu(), .numpy())"),
    ("with Meta tensors", "an operator without a meta kernel"),
    ("a meta tensor without output_size", "repeat_interleave without output_size"),
)


def has_meta_state(model: nn.Module) -> bool:
    """Whether any parameter or buffer of the model is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def meta_construct(exc: BaseException) -> str | None:
    """The data-dependent construct that made ``exc`` on meta tensors, ``None`` for others."""
    seen: BaseException | None = exc
    while seen is not None:  # torch.export wraps the original error
        text = str(seen)
        for needle, construct in _CONSTRUCTS:
            if needle in text:
                return construct
        seen = seen.__cause__ or seen.__context__
    return None


def meta_shadow(*models: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Replaces the models' real parameters and buffers by meta ones for the block.

    A model only partly on meta is traced all on meta (real and meta tensors cannot meet
    in one operator); tied tensors stay one, across the models too. The real tensors are
    put back afterwards: graphs traced inside hold the meta stand-ins until
    :func:`rebind_state`.
    """
    return swapped_state(models, lambda t: None if t.is_meta else torch.empty_like(t, device=META))


def model_attribute(model: nn.Module, path: str) -> object:
    """The attribute at ``path`` (``layers.3.mlp.weight``) of ``model``."""
    owner, _, field = path.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, field)


def rebind_state(module: nn.Module, model: nn.Module, prefix: str = "model") -> int:
    """Points every graph of ``module`` at the model's current parameters and buffers.

    A graph module holds the tensors its ``get_attr`` nodes read (``model.<name>``) in
    containers of its own, not through the model's submodules; replacing a tensor of the
    model (materializing a meta one creates a new ``Parameter``) leaves the graph reading
    the old one. Modules the graph calls are the model's own and follow by themselves.

    Args:
        module: a graph module, or a module holding graph modules (units, stages).
        model: the model the graphs were traced from.
        prefix: the name the traced root holds the model under.

    Returns:
        How many references were replaced.
    """
    replaced = 0
    for graph_module in module.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.find_nodes(op="get_attr"):
            target = str(node.target)
            if not target.startswith(prefix + "."):
                continue
            try:
                current = model_attribute(model, target[len(prefix) + 1 :])
                parent, _, field = target.rpartition(".")
                holder = graph_module.get_submodule(parent)
            except AttributeError:
                continue
            if not isinstance(current, Tensor) or getattr(holder, field, None) is current:
                continue
            if field in holder._parameters and isinstance(current, nn.Parameter):
                holder._parameters[field] = current
            elif field in holder._buffers:
                holder._buffers[field] = current
            else:
                object.__setattr__(holder, field, current)
            replaced += 1
    return replaced


def _named_state(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


def unused_meta(model: nn.Module, stages: Sequence[Sequence[nn.Module]]) -> list[list[str]]:
    """The meta tensors of the model that no stage's units use, as each stage takes them.

    A tensor no graph reads (a rotary embedding's ``original_inv_freq``) still belongs to
    the model; it goes to the first stage using another tensor of its module, else to the
    first stage. The same on every rank: it depends on the model and the stages only.

    Returns:
        The names each stage materializes besides its units' tensors.
    """
    used: list[set[int]] = [
        {id(t) for module in stage for _, t in _named_state(module)} for stage in stages
    ]
    everything = set().union(*used)
    extra: list[list[str]] = [[] for _ in stages]
    for prefix, sub in model.named_modules(remove_duplicate=False):
        own = [
            (name, t)
            for name, t in (*sub._parameters.items(), *sub._buffers.items())
            if t is not None
        ]
        siblings = {id(t) for _, t in own}
        home = next((k for k, ids in enumerate(used) if siblings & ids), 0)
        for name, tensor in own:
            if tensor.is_meta and id(tensor) not in everything:
                extra[home].append(f"{prefix}.{name}" if prefix else name)
    return extra


def meta_bytes(
    model: nn.Module, stages: Sequence[Sequence[nn.Module]], extra: Sequence[Sequence[str]]
) -> list[int]:
    """The bytes :func:`materialize_units` gives storage to, stage by stage in this order:
    each stage's meta tensors of the model (its units' and its ``extra`` names), a tensor
    several stages use counted with the first of them, as it is materialized there.
    Nothing is materialized."""
    by_id = {id(t): t for _, t in _named_state(model) if t.is_meta}
    by_name = {name: t for name, t in _named_state(model) if t.is_meta}
    counted: set[int] = set()
    sizes = []
    for modules, names in zip(stages, extra, strict=True):
        for module in modules:
            rebind_state(module, model)
        tensors = [t for module in modules for _, t in _named_state(module) if id(t) in by_id]
        tensors += [by_name[name] for name in names if name in by_name]
        size = 0
        for tensor in tensors:
            if id(tensor) not in counted:
                counted.add(id(tensor))
                size += tensor.numel() * tensor.element_size()
        sizes.append(size)
    return sizes


def materialize_units(
    model: nn.Module,
    modules: Sequence[nn.Module],
    device: str | torch.device,
    init: Callable[[nn.Module], None] | None = None,
    *,
    seed: int | None = 0,
    extra: Sequence[str] = (),
) -> nn.Module:
    """Gives the model's meta tensors that ``modules`` (one stage's units) use storage on
    ``device``, initializes them, and points the units' graphs at them.

    Only those tensors are materialized (see :func:`profiler.materialize.materialize_part`);
    tensors an earlier call materialized elsewhere (a tied parameter) are left where they
    are. The default initializers run, then ``init(part)`` if given; without ``init``, a
    tensor that no initializer writes is refused (it would train from placeholder values).

    Args:
        model: the model the units were traced from.
        modules: the stage's units.
        device: the stage's device.
        init: called as ``init(part)``, ``part`` holding the new tensors under the model's
            names (``part.state_dict()`` has the model's keys of this stage).
        seed: seeds the default initialization.
        extra: names of further meta tensors to materialize with them (see
            :func:`unused_meta`).

    Returns:
        ``part``.

    Raises:
        ValueError: a tensor is left that nothing initializes (without ``init``), or the
            units hold a meta tensor that is not the model's (a constant the trace made
            on the meta device).
    """
    for module in modules:
        rebind_state(module, model)
    used = {id(t) for module in modules for _, t in _named_state(module)}
    names = [name for name, t in _named_state(model) if t.is_meta and id(t) in used]
    names += [name for name in extra if name not in names]
    part = materialize_part(model, names, device, init, seed=seed, strict=init is None)
    for module in modules:
        rebind_state(module, model)
    left = [name for module in modules for name, t in _named_state(module) if t.is_meta]
    if left:
        raise ValueError(
            f"the units hold meta tensors that are not the model's ({', '.join(left[:3])}): "
            "the trace made them on the meta device; build the model with real weights, or "
            "create those tensors from the inputs' device in its code"
        )
    return part
