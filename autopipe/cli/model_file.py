"""Loads a user's ``model.py`` (its ``model``, ``sample`` and ``kwargs``) for the command line."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import re
import sys
import tokenize
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from autopipe import ModelFileError, TracingError

__all__: list[str] = []

Sample = Tensor | tuple[Tensor, ...]

_counter = itertools.count()

_ADD = {
    "model": "`model = nn.Sequential(...)`, the network to split (or a function returning it)",
    "sample": "`sample = torch.randn(32, ...)`, one mini-batch to plan for (a tensor or "
    "tuple of tensors, or a function returning one)",
    "kwargs": "`kwargs = {'attention_mask': mask}`, the model's keyword inputs",
}


@dataclass
class LoadedModel:
    """What a model file defines.

    Attributes:
        path: the file, resolved.
        model: the module ``model`` names (called first when it is a function).
        sample: the mini-batch to plan for: a tensor or a tuple of tensors sharing dim 0.
        module: the imported Python module.
        kwargs: the model's keyword inputs for the sample (``kwargs`` in the file, a dict or
            a function returning one; empty when the file defines none).
    """

    path: Path
    model: nn.Module
    sample: Sample
    module: ModuleType
    kwargs: dict[str, Any] = field(default_factory=dict)

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


def _check_source(path: Path) -> None:
    """Says why Python cannot read ``path`` as source text: binary, or not in its encoding."""
    try:
        data = path.read_bytes()
    except OSError:
        return  # the import reports it
    if b"\0" in data:
        raise ModelFileError(f"{path} is not Python source: it holds null bytes (a binary file?)")
    try:
        encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
    except SyntaxError as exc:
        if "unknown encoding" in str(exc):
            return  # Python's own message names the declared coding
        encoding = "utf-8"  # a first line that does not decode
    try:
        data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        byte = data[exc.start : exc.start + 1].hex()
        what = "UTF-8" if encoding == "utf-8" else encoding
        raise ModelFileError(
            f"{path} is not {what} Python source: byte 0x{byte} on line {line} does not "
            "decode; save the file as UTF-8"
        ) from None


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
        _check_source(path)
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


def _check_kwargs(value: Any, path: Path, batch: int) -> dict[str, Any]:
    """The keyword inputs: a dict by name; its tensors batch-major like the sample."""
    if not isinstance(value, dict):
        raise ModelFileError(
            f"`kwargs` in {path} must be a dict of keyword inputs (or a function returning "
            f"one), got {type(value).__name__}"
        )
    for key, item in value.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ModelFileError(
                f"`kwargs` in {path} must map argument names to inputs, got the key {key!r}"
            )
        if isinstance(item, Tensor) and (item.dim() == 0 or int(item.shape[0]) != batch):
            got = "a 0-d tensor" if item.dim() == 0 else f"dim 0 of {int(item.shape[0])}"
            raise ModelFileError(
                f"`kwargs['{key}']` in {path} must have the sample's batch size {batch} in "
                f"dim 0, got {got}"
            )
    return dict(value)


def load_model_file(path: str | Path) -> LoadedModel:
    """Imports a model file and returns its ``model``, ``sample`` and ``kwargs``.

    The file is imported under a unique module name with its directory on ``sys.path``
    while it runs, so it can import its sibling modules. ``model``, ``sample`` and the
    optional ``kwargs`` (the model's keyword inputs, called as
    ``model(*sample, **kwargs)``) may be values or zero-argument functions returning them;
    functions are called once here.

    Args:
        path: the Python file.

    Returns:
        The model (any ``nn.Module``; see :func:`as_sequential`), the sample and kwargs.

    Raises:
        ModelFileError: the file is missing, does not import, lacks a valid ``model`` or
            ``sample``, or has invalid ``kwargs``; the message is one line saying what to fix.
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
    loaded = LoadedModel(path=resolved, model=model, sample=sample, module=module)
    if hasattr(module, "kwargs"):
        loaded.kwargs = _check_kwargs(_resolve(module, "kwargs", given), given, loaded.batch_size)
    return loaded


def _check_leaves(model: nn.Module, names: Sequence[str], where: str) -> None:
    """Every leaf module name must name a submodule: tracing ignores unknown names."""
    known = dict(model.named_modules())
    for name in names:
        if not name or name not in known:
            children = ", ".join(child for child, _ in model.named_children()) or "none"
            raise ModelFileError(
                f"--leaf-modules: `model`{where} ({type(model).__name__}) has no submodule "
                f"{name!r}; give module paths such as its children ({children})"
            )


def as_sequential(
    model: nn.Module,
    sample: Sample,
    path: str | Path | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    granularity: str | None = None,
    leaf_modules: Iterable[str] = (),
) -> tuple[nn.Sequential, Sample]:
    """The model as an ``nn.Sequential`` of the layers to split, with its sample.

    An ``nn.Sequential`` is used as it is. Any other module is traced (torch.fx, else
    torch.export) and cut into units along module calls; each unit takes and returns the
    tensors live across its boundaries, and the sample (with ``kwargs``) is flattened to
    match.

    Args:
        model: the model.
        sample: its positional inputs.
        path: the model file, named in errors.
        kwargs: the model's keyword inputs (traced models only).
        granularity: how finely a traced model is cut (see :func:`autopipe.wrap`);
            ``None``: ``blocks``.
        leaf_modules: submodule paths torch.fx keeps as single calls (traced models only).

    Raises:
        ModelFileError: the model is an empty ``nn.Sequential``, an ``nn.Sequential`` given
            keyword inputs or tracing options, or cannot be traced.
    """
    where = f" in {path}" if path is not None else ""
    leaves = list(leaf_modules)
    if isinstance(model, nn.Sequential):
        if len(model) == 0:
            raise ModelFileError(f"`model`{where} is an empty nn.Sequential: it needs layers")
        if kwargs:
            raise ModelFileError(
                f"`model`{where} is an nn.Sequential, which takes no keyword inputs: remove "
                "`kwargs` or make them part of `sample`"
            )
        if granularity is not None or leaves:
            raise ModelFileError(
                f"`model`{where} is an nn.Sequential, split between its children: "
                "--granularity and --leaf-modules apply to traced models only; leave them out"
            )
        own_forward = type(model).forward is not nn.Sequential.forward
        if isinstance(sample, tuple) and len(sample) > 1 and not own_forward:
            raise ModelFileError(
                f"`model`{where} is an nn.Sequential, which takes one input, but `sample` "
                f"holds {len(sample)} tensors (the sample is the model's positional inputs, "
                "model(*sample)): make `model` a module whose forward takes them"
            )
        return model, sample
    _check_leaves(model, leaves, where)
    from autopipe.graph import unit_sequential

    args = sample if isinstance(sample, tuple) else (sample,)
    try:
        return unit_sequential(
            model,
            args,
            kwargs=kwargs,
            granularity=granularity or "blocks",
            leaf_modules=leaves,
            # The commands plan and profile the training step: the eval graph would only
            # double the trace, the longest part of planning a deep model.
            both_modes=False,
        )
    except (TracingError, ValueError) as exc:
        raise ModelFileError(
            f"cannot split `model`{where} ({type(model).__name__}) into stages automatically: "
            f"{_as_options(_one_line(str(exc)))}"
        ) from None


def _as_options(message: str) -> str:
    """The tracer's advice in the command line's words: ``--leaf-modules a,b``."""

    def leaves(match: re.Match[str]) -> str:
        names = re.findall(r"'([^']*)'", match.group(1))
        return f"--leaf-modules {','.join(names)}" if names else match.group(0)

    message = re.sub(r"leaf_modules=\[([^\]]*)\]", leaves, message)
    message = re.sub(r"\bleaf_modules=", "--leaf-modules", message)
    return re.sub(r"granularity='(\w+)'", r"--granularity \1", message)


def load_sequential(
    path: str | Path,
    dtype: str | None = None,
    *,
    granularity: str | None = None,
    leaf_modules: Iterable[str] = (),
) -> tuple[nn.Sequential, Sample]:
    """Loads a model file whose ``model`` must be split as an ``nn.Sequential``.

    Args:
        path: the Python file.
        dtype: cast the model's floating parameters and buffers and the floating tensors of
            the sample and kwargs to this dtype (see :func:`profiler.precision.cast_model`)
            before any tracing, so an auto-wrapped model is split as it will run; ``None``:
            as defined.
        granularity: see :func:`as_sequential`.
        leaf_modules: see :func:`as_sequential`.

    Raises:
        ModelFileError: see :func:`load_model_file` and :func:`as_sequential`.
        ValueError: ``dtype`` is not one of :data:`profiler.precision.DTYPES`.
    """
    _, layers, sample = load_split(path, dtype, granularity=granularity, leaf_modules=leaf_modules)
    return layers, sample


def cast_loaded(loaded: LoadedModel, dtype: str | None) -> tuple[nn.Module, Sample, dict[str, Any]]:
    """The model file's model, sample and kwargs, cast to ``dtype`` (``None``: as defined;
    see :func:`profiler.precision.cast_model`)."""
    model, sample, kwargs = loaded.model, loaded.sample, loaded.kwargs
    if dtype is not None:
        from profiler import cast_model

        model, sample = cast_model(model, sample, dtype)
        keys = [key for key, value in kwargs.items() if isinstance(value, Tensor)]
        if keys:
            _, cast = cast_model(model, tuple(kwargs[key] for key in keys), dtype)
            kwargs = {**kwargs, **dict(zip(keys, cast, strict=True))}
    return model, sample, kwargs


def load_split(
    path: str | Path,
    dtype: str | None = None,
    *,
    granularity: str | None = None,
    leaf_modules: Iterable[str] = (),
) -> tuple[nn.Module, nn.Sequential, Sample]:
    """:func:`load_sequential`, with the model its layers take their parameters from
    (which names the parameters several layers share)."""
    model, sample, kwargs = cast_loaded(load_model_file(path), dtype)
    layers, flat = as_sequential(
        model, sample, path, kwargs=kwargs, granularity=granularity, leaf_modules=leaf_modules
    )
    return model, layers, flat
