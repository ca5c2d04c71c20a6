"""The profile cache: a model file measured once is not traced nor measured again.

``autopipe plan`` and ``autopipe profile`` spend nearly all their time tracing the model
(torch.export and the checks of the trace on the sample) and measuring its units. A plan
needs neither the trace nor the units themselves, only their names, classes and costs,
all of which the profile holds: on a hit the command loads the model file (its structure
is part of the key), skips both, and plans from the cached profile.

Files live in ``$AUTOPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopipe``, else
``~/.cache/autopipe``, one ``profiles/<key>.json`` per key; ``--no-cache`` neither reads
nor writes them. An unreadable file is reported in one warning line and rewritten; a
cache that cannot be written is reported and the command goes on without it.

Why a hit may skip the trace's checks: they run the model and the graph once, on the
sample, and refuse a graph that does not reproduce the model. The graph is made from
fake tensors, so it is a function of the code (the model file, the modules it imports
from its folder, the versions of torch, of the packages it imports and of autopipe's own
source), the model's structure (module classes and modes, parameter and buffer names,
shapes, dtypes, which ones are one tensor) and constants (tensor attributes that are no
parameters nor buffers, hashed by value), the sample's and kwargs' shapes and dtypes, and
the tracing options: all in the key. The weights' and the sample's values are not: the
checks test the graph on one sample's values and the pipeline then trains it on every
batch's values, so values were never what the checks vouch for; a key with them would miss
on every model file whose sample is drawn without a seed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

import profiler
from autopipe import __version__
from autopipe.cli.options import expert_skew, tp_plan_option
from profiler import ENV_DIR, Profile, cache_dir, cpu_model, read_json, write_json

if TYPE_CHECKING:
    from autopipe.cli.model_file import LoadedModel

__all__: list[str] = []  # internal to the command line

_KIND = "cached profile"
# Bumped when what the key covers changes meaning, so that old entries miss.
_KEY_FORMAT = 1
# Modules under these folders are installed packages, covered by their versions.
_INSTALLED = ("site-packages", "dist-packages")


def _warn(message: str) -> None:
    print(f"autopipe: warning: {' '.join(message.split())}", file=sys.stderr)


# ----------------------------------------------------------------------------------------
# The key: everything the trace and the measurements depend on.


def _digest(paths: list[Path]) -> str:
    """One hash of the files' names and bytes, in the order given."""
    hasher = hashlib.sha256()
    for path in paths:
        hasher.update(str(path).encode() + b"\0")
        try:
            hasher.update(path.read_bytes())
        except OSError:
            hasher.update(b"<unreadable>")  # still a key; the same on the next run
        hasher.update(b"\0")
    return hasher.hexdigest()


def _local_modules(folder: Path) -> list[ModuleType]:
    """The imported modules whose file lies in ``folder`` or below (the model file's own
    modules), installed packages excepted."""
    # The model file's folder goes on sys.path resolved (see model_file), so its modules'
    # files start with it: a prefix test, not a resolve() of each of torch's thousands.
    prefix = str(folder).rstrip(os.sep) + os.sep
    found = []
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not isinstance(name, str) or not name.startswith(prefix):
            continue
        if any(part in _INSTALLED for part in Path(name).parts):
            continue
        found.append(module)
    return found


def _package_versions(modules: list[ModuleType]) -> dict[str, str]:
    """The versions of the packages ``modules`` use (by name or through imported names),
    with torch's, numpy's and Python's."""
    tops = {"torch", "numpy"}
    for module in modules:
        for value in list(vars(module).values()):
            try:  # a lazy object may raise anything when asked for an attribute
                owner = value.__name__ if isinstance(value, ModuleType) else None
                owner = owner or getattr(value, "__module__", None)
            except Exception:
                continue
            if isinstance(owner, str) and owner:
                tops.add(owner.split(".")[0])
    versions = {"python": platform.python_version()}
    for top in sorted(tops):
        version = getattr(sys.modules.get(top), "__version__", None)
        if isinstance(version, str):
            versions[top] = version
    return versions


def own_source() -> str:
    """A hash of autopipe's and the profiler's source: measuring code that changed without
    a new version number must not reuse old profiles."""
    files: list[Path] = []
    for folder in (Path(__file__).resolve().parents[1], Path(profiler.__file__ or "").parent):
        files.extend(sorted(folder.rglob("*.py")))
    return _digest(files)


def _tensor(value: Tensor) -> list[Any]:
    return [list(value.shape), str(value.dtype), value.device.type, value.requires_grad]


def _describe(value: Any) -> Any:
    """A sample or keyword input by shapes and dtypes; other values by their repr."""
    if isinstance(value, Tensor):
        return ["tensor", *_tensor(value)]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_describe(item) for item in value]]
    if isinstance(value, dict):
        return ["dict", [[repr(key), _describe(item)] for key, item in value.items()]]
    # An object whose repr holds its address misses on every run: safe, if useless.
    return ["value", type(value).__qualname__, repr(value)]


def _constants(model: nn.Module) -> str:
    """A hash of the tensors modules hold as plain attributes: the trace bakes them in."""
    hasher = hashlib.sha256()
    for name, module in model.named_modules():
        for attribute, value in sorted(vars(module).items()):
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                hasher.update(f"{name}.{attribute}:{_tensor(value)}".encode())
                if value.device.type == "meta":
                    continue  # no values: the trace cannot have read any
                try:
                    data = value.detach().cpu().contiguous().reshape(-1)
                    hasher.update(data.view(torch.uint8).numpy().tobytes())
                except (RuntimeError, TypeError):
                    # A layout whose bytes cannot be read (sparse, quantized): never a hit.
                    hasher.update(os.urandom(16))
    return hasher.hexdigest()


def _class_name(kind: type) -> str:
    """A class by the file that defines it: the model file is imported under a new module
    name on each run, so its classes' module names never repeat."""
    module = sys.modules.get(kind.__module__)
    where = getattr(module, "__file__", None) or kind.__module__
    return f"{where}:{kind.__qualname__}"


def _structure(model: nn.Module) -> dict[str, Any]:
    """Module classes and modes; parameters and buffers by name, shape, dtype and which of
    them are one tensor (a tied head)."""
    modules = [
        [name, _class_name(type(m)), m.training]
        for name, m in model.named_modules(remove_duplicate=False)
    ]
    first: dict[int, str] = {}
    tensors = []
    for kind, named in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, value in named:
            same = first.setdefault(id(value), name)
            tensors.append([kind, name, *_tensor(value), same])
    return {"modules": modules, "tensors": tensors, "constants": _constants(model)}


def device_identity(device: str) -> dict[str, Any]:
    """What the times depend on besides the code: the device's model, the host, threads."""
    found: dict[str, Any] = {"device": device, "host": platform.node()}
    resolved = torch.device(device)
    if resolved.type == "cuda" and torch.cuda.is_available():
        found["name"] = torch.cuda.get_device_name(resolved)
    else:
        found["name"] = cpu_model()
    found["threads"] = torch.get_num_threads()
    return found


def profile_key(
    loaded: LoadedModel,
    model: nn.Module,
    sample: Any,
    kwargs: dict[str, Any],
    args: argparse.Namespace,
    *,
    chunks: int,
    device: str,
) -> tuple[str, dict[str, Any]]:
    """The key of a profile of ``model`` (the model file's, cast to ``--dtype``), and what
    it was made of.

    Returns:
        The key (a SHA-256 in hex) and the parts it hashes, stored beside the profile so that
        a miss can be explained by comparing two entries.
    """
    local = _local_modules(loaded.path.parent)
    files = sorted({Path(m.__file__ or "").resolve() for m in local} | {loaded.path})
    parts = {
        "format": _KEY_FORMAT,
        "files": [str(path) for path in files],
        "source": _digest(files),
        "versions": {"autopipe": __version__, **_package_versions(local)},
        "autopipe_source": own_source(),
        "structure": _structure(model),
        "sample": _describe(sample),
        "kwargs": _describe(kwargs),
        "device": device_identity(device),
        "options": {
            "dtype": args.dtype,
            "autocast": args.autocast,
            "chunks": chunks,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "measure": not getattr(args, "target", None),
            "granularity": args.granularity,
            "leaf_modules": list(args.leaf_modules),
            "tp_plan": tp_plan_option(args),
            "expert_skew": expert_skew(args),
        },
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), parts


# ----------------------------------------------------------------------------------------
# Entries.


@dataclass(frozen=True)
class CacheEntry:
    """One key's place in the cache.

    Attributes:
        path: the entry's file.
        key: the key it must hold.
        parts: what the key hashes, written with the profile.
    """

    path: Path
    key: str
    parts: dict[str, Any]

    def load(self, *, quiet: bool = False) -> Profile | None:
        """The cached profile; ``None`` when there is none, or (with a warning unless
        ``quiet``) when the file cannot be read as one, which the next :meth:`store`
        rewrites."""
        if not self.path.is_file():
            return None
        try:
            data = read_json(self.path, _KIND)
            if data.get("key") != self.key:
                raise ValueError("it holds another key")
            found = data.get("profile")
            if not isinstance(found, dict):
                raise ValueError("it holds no profile")
            return Profile.from_dict(found)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            if quiet:
                return None
            _warn(f"ignoring the cached profile {self.path} ({exc}); profiling again")
            return None

    def store(self, profile: Profile) -> None:
        """Writes the entry atomically; a failure is a warning, not an error."""
        data = {"key": self.key, "parts": self.parts, "profile": profile.to_dict()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, _KIND, data)
        except OSError as exc:
            _warn(
                f"cannot write the profile cache {self.path}: {exc.strerror or exc}; "
                f"set {ENV_DIR} to a writable folder or pass --no-cache"
            )


def cache_entry(
    loaded: LoadedModel,
    model: nn.Module,
    sample: Any,
    kwargs: dict[str, Any],
    args: argparse.Namespace,
    *,
    chunks: int,
    device: str,
) -> CacheEntry | None:
    """The entry of this profile (see :func:`profile_key`); ``None`` with ``--no-cache``
    and for commands without that option."""
    if getattr(args, "no_cache", True):
        return None
    key, parts = profile_key(loaded, model, sample, kwargs, args, chunks=chunks, device=device)
    return CacheEntry(cache_dir() / "profiles" / f"{key}.json", key, parts)
