"""A model's tensor-parallel plan, and the style it gives each parameter of each unit.

A plan maps module-name patterns to styles, the ecosystem's own convention (Hugging Face's
``tp_plan``): a pattern is a module's full dotted name in which ``*`` stands for one part,
``model.layers.*.self_attn.q_proj``; the styles are those of
:data:`profiler.SHARD_STYLES` (``colwise``, ``rowwise``, ``embedding_rowwise``, ...).

The plan used is, in order: the one given (``tp_plan=``, the command line's
``--tp-plan FILE``), else a Hugging Face model's own (``model._tp_plan``, full names; else
its config's ``base_model_tp_plan`` under the base model's prefix), else none. Units are
traced modules holding the model's own parameter objects, so each unit parameter finds its
full name, and with it its module's style, by identity.

The matching rule, one for the counter and the distributed runner: a module takes the
style of the pattern naming it, else that of its nearest named ancestor (a style on a
block, such as ``gather``, covers the modules inside it); at one depth an exact name wins
over a pattern with ``*`` (fewer ``*`` first, then the plan's order). Transformers' own
matcher replaces a name's layer numbers by ``*`` and looks the result up, for a parameter
its own name then its module's: a Hugging Face plan (patterns whose ``*`` stand for layer
numbers) never has two matching keys at one depth, so it styles every ``nn.Linear`` and
``nn.Embedding`` as transformers does; the ancestor rule and exact numbered names only add
to it (a block's style, one layer styled apart from the others).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import nn

from profiler import SHARD_STYLES

__all__ = ["check_tp_plan", "model_tp_plan", "module_styles", "read_tp_plan", "shard_styles"]

_EXAMPLE = 'e.g. {"model.layers.*.mlp.down_proj": "rowwise"}'


def read_tp_plan(path: str | Path) -> dict[str, str]:
    """The plan in a JSON file: one object of module-name patterns to styles.

    Raises:
        ValueError: the file cannot be read, is no such object, or names an unknown style
            (one line saying what and how to fix it).
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the tensor-parallel plan {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"the tensor-parallel plan {path} is not JSON ({exc.msg} at line {exc.lineno}); "
            f"write one object of module-name patterns to styles, {_EXAMPLE}"
        ) from None
    return check_tp_plan(data, str(path))


def check_tp_plan(plan: object, where: str = "tp_plan") -> dict[str, str]:
    """``plan`` as a dict of patterns to known styles.

    Raises:
        ValueError: not a mapping of strings to strings, or a style is unknown.
    """
    if not isinstance(plan, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
    ):
        raise ValueError(
            f"the tensor-parallel plan {where} must map module-name patterns to style "
            f"names, {_EXAMPLE}"
        )
    for pattern, style in plan.items():
        if style not in SHARD_STYLES:
            raise ValueError(
                f"the tensor-parallel plan {where} gives {pattern!r} the unknown style "
                f"{style!r}; use one of {', '.join(SHARD_STYLES)}"
            )
    return dict(plan)


def model_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own plan in full module names, ``None`` when it has none."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not isinstance(base, Mapping) or not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    inner = bool(prefix) and isinstance(getattr(model, str(prefix), None), nn.Module)
    return {(f"{prefix}.{k}" if inner else k): v for k, v in base.items()}


def _matches(pattern: list[str], name: list[str]) -> bool:
    return len(pattern) == len(name) and all(
        p in ("*", part) for p, part in zip(pattern, name, strict=True)
    )


def _patterns(plan: Mapping[str, str]) -> list[tuple[list[str], str]]:
    """The plan's patterns split into parts, exact names before patterns (fewer ``*``
    first; a stable sort keeps the plan's order among equals)."""
    split = [(pattern.split("."), style) for pattern, style in plan.items()]
    return sorted(split, key=lambda item: item[0].count("*"))


def _style(plan: list[tuple[list[str], str]], module: str) -> str | None:
    """The style of ``module``: its own pattern's, else its nearest ancestor's."""
    parts = module.split(".") if module else []
    for end in range(len(parts), 0, -1):
        for pattern, style in plan:
            if _matches(pattern, parts[:end]):
                return style
    return None


def _check_matches(owner: nn.Module, plan: Mapping[str, str]) -> None:
    modules = [name.split(".") for name, _ in owner.named_modules(remove_duplicate=False)]
    for pattern in plan:
        parts = pattern.split(".")
        if not any(_matches(parts, name) for name in modules):
            raise ValueError(
                f"the tensor-parallel plan's pattern {pattern!r} matches no module of "
                f"{type(owner).__name__}; name modules by their full dotted path, `*` for "
                "one part (e.g. model.layers.*.mlp.down_proj), or remove it"
            )


def module_styles(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Each module of ``model`` (by its full name) that ``plan`` styles, with its style.

    The module-level rule of this module's docstring: its own pattern, else its nearest
    ancestor's; an exact name before a pattern at one depth. Modules without a style are
    left out.

    Raises:
        ValueError: an unknown style (:func:`check_tp_plan`).
    """
    patterns = _patterns(check_tp_plan(plan))
    styles: dict[str, str] = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        style = _style(patterns, name)
        if style is not None:
            styles[name] = style
    return styles


def shard_styles(
    owner: nn.Module,
    layers: Sequence[nn.Module],
    tp_plan: Mapping[str, str] | None = None,
) -> list[dict[str, str]] | None:
    """Each layer's parameters, by their names in the layer, mapped to the style of the
    module owning them in ``owner`` (the model the layers were traced from).

    Args:
        owner: the model; its module names are what the plan's patterns match.
        layers: its units (or any modules holding its parameters).
        tp_plan: the plan; default: the model's own (:func:`model_tp_plan`).

    Returns:
        One map per layer (parameters without a style left out), for
        ``profile_layers(..., shard_styles=...)``; ``None`` without a plan.

    Raises:
        ValueError: an unknown style, or a pattern of ``tp_plan`` that matches no module of
            ``owner`` (the model's own plan may name modules of configurations it does not
            have, DeepSeek's ``q_proj`` beside ``q_a_proj``).
    """
    found = model_tp_plan(owner) if tp_plan is None else tp_plan
    if found is None:
        return None
    plan = check_tp_plan(found)
    if tp_plan is not None:  # a model's own plan also names modules of other configurations
        _check_matches(owner, plan)
    patterns = _patterns(plan)
    names: dict[int, list[str]] = {}
    for name, tensor in owner.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    result = []
    for layer in layers:
        styles: dict[str, str] = {}
        for local, tensor in layer.named_parameters(remove_duplicate=False):
            for full in names.get(id(tensor), []):
                style = _style(patterns, full.rpartition(".")[0])
                if style is not None:
                    styles[local] = style
                    break
        result.append(styles)
    return result
