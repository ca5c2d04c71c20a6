"""The names a profile gives the layers of an ``nn.Sequential``, and how two names match."""

from __future__ import annotations

from torch import nn

__all__ = ["layer_names", "same_layer_name"]


def layer_names(model: nn.Sequential) -> list[str]:
    """The layers' names: the model's ``layer_names`` when it has them, else its children's.

    A traced model's units are named by the fully qualified names of the modules they
    call (``transformer.h.3``), as ``named_modules()`` gives them; an ``nn.Sequential``
    child name cannot hold a dot, so such a Sequential keeps its children under other keys
    and lists the names in a ``layer_names`` attribute.
    """
    names = getattr(model, "layer_names", None)
    children = [name for name, _ in model.named_children()]
    if isinstance(names, list) and len(names) == len(children):
        return [str(name) for name in names]
    return children


def same_layer_name(recorded: str, name: str) -> bool:
    """Whether a profile's layer name ``recorded`` names the layer ``name``.

    Profiles saved before units were named by their modules' dotted names wrote
    ``transformer/h/3``: both spellings match.
    """
    return recorded == name or recorded.replace("/", ".") == name.replace("/", ".")
