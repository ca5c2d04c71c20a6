"""Loads a user's ``model.py`` (its ``model`` and ``sample``) for the command line."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor, nn

__all__ = [
    "LoadedModel",
    "ModelFileError",
    "as_sequential",
    "load_model_file",
    "load_sequential",
]

Sample = Tensor | tuple[Tensor, ...]

_counter = itertools.count()

_ADD = {
    "model": "`model = nn.Sequential(...)`, the network to split (or a function returning it)",
    "sample": "`sample = torch.randn(32, ...)`, one mini-batch to plan for (a tensor or "
    "tuple of tensors, or a function returning one)",
}


class ModelFileError(ValueError):
    """A model file cannot be used; the one-line message says what to fix."""


@dataclass
class LoadedModel:
    """What a model file defines.

    Attributes:
        path: the file, resolved.
        model: the module ``model`` names (called first when it is a function).
        sample: the mini-batch to plan for: a tensor or a tuple of tensors sharing dim 0.
        module: the imported Python module.
    """

    path: Path
    model: nn.Module
    sample: Sample
    module: ModuleType

    @property
    def batch_size(self) -> int:
        """The sample's batch size (dim 0)."""
        first = self.sample if isinstance(self.sample, Tensor) else self.sample[0]
        return int(first.shape[0])


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _describe(exc: BaseException) -> str:
    message = _one_line(str(exc))
    name = type(exc).__name__
    return f"{name}: {message}" if message else name


def _user_line(exc: BaseException, path: Path) -> int | None:
    """The line of ``path`` closest to where ``exc`` was raised, if it passed through it."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            same = Path(frame.filename).resolve() == path
        except (OSError, ValueError):
            same = False
        if same:
            line = frame.lineno
    return line


def _import(path: Path) -> ModuleType:
    """Imports ``path`` under a unique module name with its directory on ``sys.path``."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_autopipe_model_{path.stem}_{digest}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {path}: is it a Python file?")
    module = importlib.util.module_from_spec(spec)
    directory = str(path.parent)
    sys.path.insert(0, directory)
    # Registered first so that dataclasses, pickling and the like can find the module.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        where = exc.filename or str(path)
        line = f" line {exc.lineno}" if exc.lineno else ""
        raise ModelFileError(f"syntax error in {where}{line}: {_one_line(exc.msg)}") from None
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        lineno = _user_line(exc, path)
        where = f"{path} line {lineno}" if lineno else str(path)
        raise ModelFileError(f"importing {where} raised {_describe(exc)}") from None
    finally:
        # Remove our entry only; the module may have edited sys.path itself.
        if directory in sys.path:
            sys.path.remove(directory)
    return module


def _resolve(module: ModuleType, attribute: str, path: Path) -> Any:
    """The attribute's value, calling it first when it is a zero-argument function."""
    if not hasattr(module, attribute):
        raise ModelFileError(f"{path} defines no `{attribute}`: add {_ADD[attribute]}")
    value = getattr(module, attribute)
    if callable(value) and not isinstance(value, nn.Module):
        try:
            value = value()
        except Exception as exc:
            lineno = _user_line(exc, path)
            where = f"{path} line {lineno}" if lineno else str(path)
            raise ModelFileError(
                f"calling `{attribute}()` from {where} raised {_describe(exc)}; "
                f"`{attribute}` must be a value or a function taking no arguments"
            ) from None
    return value


def _check_model(value: Any, path: Path) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise ModelFileError(
            f"`model` in {path} must be an nn.Module (or a function returning one), "
            f"got {type(value).__name__}"
        )
    return value


def _check_sample(value: Any, path: Path) -> Sample:
    if isinstance(value, Tensor):
        tensors: tuple[Tensor, ...] = (value,)
    elif isinstance(value, (tuple, list)) and value:
        if not all(isinstance(t, Tensor) for t in value):
            kinds = ", ".join(type(t).__name__ for t in value)
            raise ModelFileError(
                f"`sample` in {path} must be a tensor or a tuple of tensors, got a "
                f"{type(value).__name__} of {kinds}"
            )
        tensors = tuple(value)
    else:
        got = "an empty tuple" if isinstance(value, (tuple, list)) else type(value).__name__
        raise ModelFileError(
            f"`sample` in {path} must be a tensor or a tuple of tensors (or a function "
            f"returning one), got {got}"
        )
    if any(t.dim() == 0 for t in tensors):
        raise ModelFileError(
            f"`sample` in {path} needs a batch dimension (dim 0); got a 0-d tensor"
        )
    sizes = [int(t.shape[0]) for t in tensors]
    if len(set(sizes)) > 1:
        raise ModelFileError(
            f"`sample` tensors in {path} disagree on the batch size (dim 0): {sizes}"
        )
    if sizes[0] == 0:
        raise ModelFileError(f"`sample` in {path} has an empty batch (dim 0 is 0)")
    return value if isinstance(value, Tensor) else tensors


def load_model_file(path: str | Path) -> LoadedModel:
    """Imports a model file and returns its ``model`` and ``sample``.

    The file is imported under a unique module name with its directory on ``sys.path``
    while it runs, so it can import its sibling modules. ``model`` and ``sample`` may be
    values or zero-argument functions returning them; functions are called once here.

    Args:
        path: the Python file.

    Returns:
        The model (any ``nn.Module``; see :func:`as_sequential`) and the sample.

    Raises:
        ModelFileError: the file is missing, does not import, or lacks a valid ``model``
            or ``sample``; the message is one line saying what to fix.
    """
    given = Path(path)
    if not given.exists():
        raise ModelFileError(f"model file {given} not found")
    if given.is_dir():
        raise ModelFileError(f"{given} is a directory; give the path of a Python file")
    resolved = given.resolve()
    module = _import(resolved)
    model = _check_model(_resolve(module, "model", given), given)
    sample = _check_sample(_resolve(module, "sample", given), given)
    return LoadedModel(path=resolved, model=model, sample=sample, module=module)


def as_sequential(
    model: nn.Module, sample: Sample, path: str | Path | None = None
) -> tuple[nn.Sequential, Sample]:
    """The model as an ``nn.Sequential`` of the layers to split, with its sample.

    An ``nn.Sequential`` is used as it is. Any other module is traced (torch.fx, else
    torch.export) and cut into units along module calls; each unit takes and returns the
    tensors live across its boundaries, and the sample is flattened to match.

    Raises:
        ModelFileError: the model is an empty ``nn.Sequential`` or cannot be traced.
    """
    where = f" in {path}" if path is not None else ""
    if isinstance(model, nn.Sequential):
        if len(model) == 0:
            raise ModelFileError(f"`model`{where} is an empty nn.Sequential: it needs layers")
        return model, sample
    from autopipe.tracing import TracingError
    from autopipe.wrapping import unit_sequential

    args = sample if isinstance(sample, tuple) else (sample,)
    try:
        return unit_sequential(model, args)
    except (TracingError, ValueError) as exc:
        raise ModelFileError(
            f"cannot split `model`{where} ({type(model).__name__}) into stages automatically: "
            f"{_one_line(str(exc))}"
        ) from None


def load_sequential(path: str | Path, dtype: str | None = None) -> tuple[nn.Sequential, Sample]:
    """Loads a model file whose ``model`` must be split as an ``nn.Sequential``.

    Args:
        path: the Python file.
        dtype: cast the model's floating parameters and buffers and the sample's floating
            tensors to this dtype (see :func:`profiler.precision.cast_model`) before any
            tracing, so an auto-wrapped model is split as it will run; ``None``: as defined.

    Raises:
        ModelFileError: see :func:`load_model_file` and :func:`as_sequential`.
        ValueError: ``dtype`` is not one of :data:`profiler.precision.DTYPES`.
    """
    loaded = load_model_file(path)
    model, sample = loaded.model, loaded.sample
    if dtype is not None:
        from profiler.precision import cast_model

        model, sample = cast_model(model, sample, dtype)
    return as_sequential(model, sample, path)
