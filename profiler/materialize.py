"""Gives the meta-device tensors of a module real storage on a device, and initializes them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["has_meta", "materialize", "meta_tensors"]

# The spread of the random weights a tensor without an initializer of its own gets: small,
# as language models start (0.02), so that activations stay finite through deep stacks.
_FILL_STD = 0.02


def meta_tensors(module: nn.Module) -> list[str]:
    """The names of the module's parameters and buffers on the meta device."""
    state = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return [name for name, tensor in state if tensor.is_meta]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of the module is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _fill(tensor: Tensor, parameter: bool, generator: torch.Generator | None) -> None:
    """Random small values for floating parameters, zeros for the rest (a tensor without an
    initializer: its values matter for what the model computes, not for what it costs)."""
    if parameter and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.normal_(0.0, _FILL_STD, generator=generator)
    else:
        tensor.zero_()


def materialize(
    module: nn.Module,
    device: str | torch.device,
    init: Callable[[nn.Module], None] | None = None,
    *,
    seed: int | None = 0,
) -> nn.Module:
    """Replaces the module's meta-device parameters and buffers, in place, by tensors on
    ``device``, then initializes them.

    Tensors already on a real device are left alone. A tensor several submodules share
    (a tied embedding and head) stays one tensor. Each new tensor is first filled (floating
    parameters with ``normal(0, 0.02)``, everything else with zeros); then ``init(module)``
    runs if given, else the ``reset_parameters()`` of every submodule that held a meta
    tensor and has one, so that layers start as their constructors would start them.

    Args:
        module: the module; its meta tensors are replaced by new ``nn.Parameter`` and
            tensor objects (the meta ones have no storage to keep).
        device: where the new tensors live.
        init: initializes the materialized module in place (e.g. loads its part of a
            checkpoint); ``None``: the submodules' own ``reset_parameters``.
        seed: seeds the random fill and the default initializers, so that two calls give
            the same values; ``None``: the global generator.

    Returns:
        The module itself.
    """
    target = torch.device(device)
    made: dict[int, Tensor] = {}
    touched: list[nn.Module] = []  # the submodules that held a meta tensor themselves
    for sub in module.modules():
        if any(
            t is not None and t.is_meta for t in (*sub._parameters.values(), *sub._buffers.values())
        ):
            touched.append(sub)
        for name, param in list(sub._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in made:
                    fresh = torch.empty_like(param, device=target)
                    made[id(param)] = nn.Parameter(fresh, requires_grad=param.requires_grad)
                sub._parameters[name] = made[id(param)]  # type: ignore[assignment]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                if id(buffer) not in made:
                    made[id(buffer)] = torch.empty_like(buffer, device=target)
                sub._buffers[name] = made[id(buffer)]
    if not made:
        return module
    devices = [target.index or 0] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        for tensor in made.values():
            _fill(tensor, isinstance(tensor, nn.Parameter), None)
        if init is not None:
            init(module)
        else:
            for sub in touched:
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    return module
