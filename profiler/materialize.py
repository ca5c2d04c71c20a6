"""Gives the meta-device tensors of a module real storage on a device, and initializes them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

__all__ = ["materialize_part"]

# The spread of the random weights a tensor without an initializer of its own gets: small,
# as language models start (0.02), so that activations stay finite through deep stacks.
_FILL_STD = 0.02

Init = Callable[[nn.Module], None]


def _state(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


def meta_tensors(module: nn.Module) -> list[str]:
    """The names of the module's parameters and buffers on the meta device."""
    return [name for name, tensor in _state(module) if tensor.is_meta]


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


def _replace(module: nn.Module, chosen: set[int] | None, target: torch.device) -> dict[int, Tensor]:
    """Replaces the meta tensors (those in ``chosen``, by identity) by empty ones on
    ``target``; the new tensors by the identity of the meta ones."""
    made: dict[int, Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, old in list(table.items()):
                if old is None or not old.is_meta or (chosen is not None and id(old) not in chosen):
                    continue
                if id(old) not in made:
                    fresh = torch.empty_like(old, device=target)
                    if isinstance(old, nn.Parameter):
                        fresh = nn.Parameter(fresh, requires_grad=old.requires_grad)
                    made[id(old)] = fresh
                table[name] = made[id(old)]  # type: ignore[assignment]
    return made


def _hf_owners(module: nn.Module) -> dict[int, nn.Module]:
    """The innermost Hugging Face model (a module with ``_init_weights`` and a ``config``)
    holding each submodule, by identity: the one whose initializer applies to it."""
    owners: dict[int, nn.Module] = {}

    def walk(sub: nn.Module, owner: nn.Module | None) -> None:
        if callable(getattr(sub, "_init_weights", None)) and hasattr(sub, "config"):
            owner = sub
        if owner is not None:
            owners.setdefault(id(sub), owner)
        for child in sub.children():
            walk(child, owner)

    walk(module, None)
    return owners


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Children before their parent, as Hugging Face applies its initializer."""
    for child in module.children():
        yield from _post_order(child)
    yield module


def _default_init(module: nn.Module, fresh: set[int]) -> None:
    """Runs the initializers that exist for the new tensors (ids in ``fresh``).

    Every submodule whose own tensors are all new runs its ``reset_parameters()``; then, in
    a Hugging Face model, its own ``_init_weights`` runs on each such submodule and on each
    whose tensors, its children's included, are all new (children first, as the model's
    ``post_init`` does), so that norms, rotary frequencies and scaled projections start as
    the model starts them. A module that also holds real tensors is not re-initialized.
    """
    owners = _hf_owners(module)
    seen: set[int] = set()
    for sub in _post_order(module):
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        own = [t for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None]
        # A module also holding real tensors is not reset: they are left alone.
        holds = bool(own) and all(id(t) in fresh for t in own)
        everything = [t for _, t in _state(sub)]
        covered = bool(everything) and all(id(t) in fresh for t in everything)
        reset = getattr(sub, "reset_parameters", None)
        if holds and callable(reset):
            reset()
        owner = owners.get(id(sub))
        if owner is not None and (holds or covered):
            owner._init_weights(sub)  # type: ignore[operator]


def _seeded(seed: int | None, device: torch.device) -> AbstractContextManager[None]:
    devices = [device.index or 0] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices, enabled=seed is not None)


def materialize(
    module: nn.Module,
    device: str | torch.device,
    init: Init | None = None,
    *,
    seed: int | None = 0,
) -> nn.Module:
    """Replaces the module's meta-device parameters and buffers, in place, by tensors on
    ``device``, then initializes them.

    Tensors already on a real device are left alone. A tensor several submodules share
    (a tied embedding and head) stays one tensor. Each new tensor is first filled (floating
    parameters with ``normal(0, 0.02)``, everything else with zeros); then ``init(module)``
    runs if given, else the initializers that exist: the ``reset_parameters()`` of every
    submodule that held a meta tensor, then in a Hugging Face model its own
    ``_init_weights`` (norms, rotary ``inv_freq``...), so that layers start as their
    constructors would start them. A tensor that no initializer covers keeps the fill:
    values fit for timing, not for training (see :func:`materialize_part`'s ``strict``).

    Args:
        module: the module; its meta tensors are replaced by new ``nn.Parameter`` and
            tensor objects (the meta ones have no storage to keep).
        device: where the new tensors live.
        init: initializes the materialized module in place (e.g. loads its part of a
            checkpoint); ``None``: the submodules' own initializers.
        seed: seeds the random fill and the default initializers, so that two calls give
            the same values; ``None``: the global generator.

    Returns:
        The module itself.
    """
    target = torch.device(device)
    made = _replace(module, None, target)
    if not made:
        return module
    with _seeded(seed, target), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        for tensor in made.values():
            _fill(tensor, isinstance(tensor, nn.Parameter), None)
        if init is not None:
            init(module)
        else:
            _default_init(module, {id(t) for t in made.values()})
    return module


def _part_view(module: nn.Module, fresh: set[int]) -> nn.Module:
    """A module holding the new tensors under their names in ``module``: the submodules
    all of whose tensors are new themselves, plain containers elsewhere."""

    def covered(sub: nn.Module) -> bool:
        tensors = [t for _, t in _state(sub)]
        return bool(tensors) and all(id(t) in fresh for t in tensors)

    def holds(sub: nn.Module) -> bool:
        return any(id(t) in fresh for _, t in _state(sub))

    def build(sub: nn.Module) -> nn.Module:
        if covered(sub):
            return sub
        view = nn.Module()
        for name, param in sub._parameters.items():
            if param is not None and id(param) in fresh:
                view.register_parameter(name, param)
        for name, buffer in sub._buffers.items():
            if buffer is not None and id(buffer) in fresh:
                persistent = name not in sub._non_persistent_buffers_set
                view.register_buffer(name, buffer, persistent=persistent)
        for name, child in sub.named_children():
            if holds(child):
                view.add_module(name, build(child))
        return view

    return build(module)


def materialize_part(
    module: nn.Module,
    names: Collection[str],
    device: str | torch.device,
    init: Init | None = None,
    *,
    seed: int | None = 0,
    strict: bool = False,
) -> nn.Module:
    """Materializes only the named meta tensors of ``module`` on ``device``, in place: one
    pipeline stage's part, without the rest of the model ever getting storage.

    The named tensors that are on meta get new tensors on ``device`` (a tied tensor stays
    one, under all its names), filled as :func:`materialize` fills them; the existing
    initializers run for them (``reset_parameters``, a Hugging Face model's
    ``_init_weights``, see :func:`materialize`), then ``init(part)`` if given. ``part`` is
    a module holding exactly the new tensors under their names in ``module``:
    ``part.state_dict()`` has the model's keys of this part (non-persistent buffers aside,
    as in any state_dict), so ``part.load_state_dict(checkpoint, strict=False)`` loads it;
    the submodules all of whose tensors are new are the model's own modules there (for
    type-based initialization), the others plain containers of the new tensors.

    Args:
        module: the model.
        names: qualified names of its parameters and buffers; those not on meta are
            skipped.
        device: where the new tensors live.
        init: called as ``init(part)`` after the default initializers, to set or load
            the part's values in place.
        seed: seeds the fill and the default initializers; ``None``: the global generator.
        strict: refuse tensors that neither an initializer nor ``init`` wrote (they would
            train from the placeholder fill).

    Returns:
        ``part`` (empty when nothing was on meta).

    Raises:
        ValueError: a name is not a parameter or buffer of ``module``, or (``strict``) a
            new tensor was written by no initializer; the message names them.
    """
    state = _state(module)
    by_name = dict(state)
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise ValueError(
            f"{', '.join(unknown[:3])} {'is' if len(unknown) == 1 else 'are'} not a "
            f"parameter or buffer of {type(module).__name__}"
        )
    chosen = {id(by_name[n]) for n in names if by_name[n].is_meta}
    target = torch.device(device)
    made = _replace(module, chosen, target)
    fresh = {id(t) for t in made.values()}
    part = _part_view(module, fresh)
    if not made:
        return part
    with _seeded(seed, target), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        for tensor in made.values():
            _fill(tensor, isinstance(tensor, nn.Parameter), None)
        filled = {id(t): t._version for t in made.values()}
        _default_init(module, fresh)
        if init is not None:
            init(part)
    if strict:
        unset = [n for n, t in _state(module) if filled.get(id(t)) == t._version]
        if unset:
            shown = ", ".join(unset[:4]) + (f" and {len(unset) - 4} more" if len(unset) > 4 else "")
            raise ValueError(
                f"nothing initializes {shown} (materialized from the meta device: their "
                "modules have no reset_parameters and no model initializer covers them); "
                "pass init= to set or load them"
            )
    return part
