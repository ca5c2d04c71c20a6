"""A package's face that loads each of its names' modules on first use.

A face (a package's ``__init__``) lists the names other packages may import and the
module each lives in; a name's module is imported only when the name is first looked up,
so importing the face costs nothing and loads neither torch nor numpy. It lives in the
profiler, the ground floor, because both the profiler's face and autopipe's use it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__: list[str] = []


def lazy_face(
    package: str, homes: Mapping[str, str], modules: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Returns a face's module ``__getattr__`` and ``__dir__`` (PEP 562).

    Args:
        package: the face's module name (``__name__`` of the ``__init__``).
        homes: each public name -> the module that defines it, imported on first use.
        modules: short names that stand for whole modules (``autopipe.timeline``).

    Returns:
        ``(__getattr__, __dir__)``, to assign at the face's top level.
    """
    shortcuts = dict(modules or {})
    namespace = vars(sys.modules[package])

    # Each lookup reads the home module again rather than keeping the value in the face:
    # ``from profiler import profile_model`` in a function then sees what the home module
    # holds now, as an import from the home module would (a test may have replaced it).
    def __getattr__(name: str) -> Any:
        if name in shortcuts:
            return importlib.import_module(shortcuts[name])
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ()), *shortcuts})

    return __getattr__, __dir__
