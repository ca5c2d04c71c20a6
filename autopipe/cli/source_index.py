"""The source index: a model file whose inputs did not change is not run again to plan.

A hit of the profile cache (:mod:`autopipe.cli.cache`) skips the trace and the
measurements, but its key needs the model's structure, so the model file still runs:
for a Hugging Face model that is most of the command (importing transformers, building
the model). The index remembers, per model file and options, what the last run of the
file read and which cached profile it led to:

- the files: the model file, the modules it imported from outside the installed packages
  and the standard library, and the files it opened for reading (a config beside it, a
  downloaded config in a hub cache), each by its bytes (by size and time for a file over
  64 MiB, such as a checkpoint);
- the versions of every installed distribution the process had imported;
- the environment variables the file read through ``os.environ`` or ``os.getenv``, with
  their values (or their absence);
- the sample's batch size, from which the micro-batch count follows.

When every recorded item is unchanged, ``autopipe plan`` and ``autopipe profile`` plan
from that profile without running the model file: the same inputs give the same file.
What the index cannot see makes it miss or be wrong in one way only: a file whose
result depends on something else (the clock, a socket, an environment variable read
from C code) — pass ``--no-cache`` for such a file. A miss costs nothing but the normal
path, which writes the index again.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import profiler
from autopipe.cli.options import expert_skew, tp_plan_option
from profiler import read_json, write_json

if TYPE_CHECKING:
    from autopipe.cli.cache import CacheEntry
    from autopipe.cli.model_file import LoadedModel
    from profiler import Profile

__all__: list[str] = []  # internal to the command line

_KIND = "source index"
_FORMAT = 1
_LARGE = 64 << 20  # bytes: bigger files are known by size and time, not hashed
_INSTALLED = ("site-packages", "dist-packages", "__pycache__")


# ----------------------------------------------------------------------------------------
# Recording what a model file reads.


@dataclass
class Reads:
    """What one run of a model file read: files, environment variables, modules."""

    files: set[str] = field(default_factory=set)
    environment: dict[str, str | None] = field(default_factory=dict)
    modules_before: set[str] = field(default_factory=set)
    modules: list[str] = field(default_factory=list)


_recording: list[Reads] = []  # the active recorder, when one is
_hooked = False


def _outside_installed(path: str) -> bool:
    """Whether ``path`` is a user's file: not an installed package's, Python's, the OS's
    nor autopipe's (whose source is in the key)."""
    own = (str(Path(__file__).resolve().parents[1]), str(Path(profiler.__file__ or "").parent))
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, "/proc", "/sys", "/dev", *own}
    if any(path == p or path.startswith(p.rstrip(os.sep) + os.sep) for p in prefixes if p):
        return False
    return not any(part in _INSTALLED for part in Path(path).parts)


def _writes(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str):
        return any(letter in mode for letter in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR))


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Called for every audited event of the process: return at once unless recording.
    if event != "open" or not _recording:
        return
    path, mode, flags = (*args, None, None, None)[:3]
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)) or _writes(mode, flags):
        return
    _recording[-1].files.add(os.path.abspath(os.fspath(path)))


class _RecordingEnviron:
    """Patches ``os.environ`` lookups (``[]``, ``get``, ``in``, ``os.getenv``) to note
    the names and values read."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self.original = type(os.environ).__getitem__

    def __enter__(self) -> None:
        original, reads = self.original, self.reads

        def getitem(environ: Any, key: Any) -> Any:
            try:
                value = original(environ, key)
            except KeyError:
                if isinstance(key, str):
                    reads.environment.setdefault(key, None)
                raise
            if isinstance(key, str) and isinstance(value, str):
                reads.environment.setdefault(key, value)
            return value

        type(os.environ).__getitem__ = getitem  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        type(os.environ).__getitem__ = self.original  # type: ignore[method-assign]


@contextmanager
def recording() -> Iterator[Reads]:
    """Notes the files, environment variables and modules read inside the block."""
    global _hooked
    if not _hooked:  # an audit hook cannot be removed: one, idle outside recording
        sys.addaudithook(_audit)
        _hooked = True
    reads = Reads(modules_before=set(sys.modules))
    _recording.append(reads)
    try:
        with _RecordingEnviron(reads):
            yield reads
    finally:
        _recording.pop()
        for name in set(sys.modules) - reads.modules_before:
            file = getattr(sys.modules.get(name), "__file__", None)
            if isinstance(file, str):
                reads.modules.append(os.path.abspath(file))


# ----------------------------------------------------------------------------------------
# What the index compares.


def _file_state(path: str) -> str | None:
    """A file by its bytes (by size and time when large); ``None`` when it is not one."""
    try:
        stat = os.stat(path)
        if not os.path.isfile(path):
            return None
        if stat.st_size > _LARGE:
            return f"size {stat.st_size} time {stat.st_mtime_ns}"
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _distribution_versions() -> dict[str, str | None]:
    """The version of each installed distribution that provides an imported module."""
    tops = {name.split(".")[0] for name in list(sys.modules)}
    provided = importlib.metadata.packages_distributions()
    names = {dist for top in tops for dist in provided.get(top, ())}
    return {name: _version(name) for name in sorted(names)}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _environment_now(names: dict[str, str | None]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def _index_key(
    path: Path, args: argparse.Namespace, device: dict[str, Any], own: dict[str, str]
) -> str:
    """The index entry's name: the model file and every option the profile depends on."""
    parts = {
        "format": _FORMAT,
        "file": str(path),
        "python": platform.python_version(),
        "autopipe": own,
        "device": device,
        "options": {
            "dtype": args.dtype,
            "autocast": args.autocast,
            "chunks": args.chunks,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "measure": not getattr(args, "target", None),
            "granularity": args.granularity,
            "leaf_modules": list(args.leaf_modules),
            "tp_plan": tp_plan_option(args),
            "expert_skew": expert_skew(args),
            "sequence": getattr(args, "sequence", None),
        },
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------------------
# Entries.


@dataclass(frozen=True)
class SourceIndex:
    """One model file's and options' entry.

    Attributes:
        path: the entry's file.
        key: the key it must hold.
        chunks: ``--chunks`` as given (``None``: the default for the stages and batch).
    """

    path: Path
    key: str
    chunks: int | None = None

    def _read(self) -> dict[str, Any] | None:
        if not self.path.is_file():
            return None
        try:
            data = read_json(self.path, _KIND)
        except (ValueError, OSError):
            return None  # rewritten by the next store
        return data if data.get("key") == self.key else None

    def lookup(self, stages: int, batch: int | None) -> tuple[Profile, int, Path] | None:
        """The cached profile, its micro-batch count for ``stages`` stages (and ``batch``,
        default the sample's) and its file, when every file, distribution version and
        environment variable the last run of the model file read is unchanged."""
        from autopipe.cli.cache import CacheEntry, cache_dir
        from autopipe.planning import default_chunks

        data = self._read()
        if data is None:
            return None
        try:
            files: dict[str, str] = data["files"]
            versions: dict[str, str | None] = data["distributions"]
            environment: dict[str, str | None] = data["environment"]
            if any(_file_state(name) != state for name, state in files.items()):
                return None
            if any(_version(name) != version for name, version in versions.items()):
                return None
            if _environment_now(environment) != environment:
                return None
            batch_size = int(data["batch_size"])
            profiles: dict[str, str] = data["profiles"]
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        chunks: int = self.chunks or default_chunks(stages, batch or batch_size)
        key = profiles.get(str(chunks))
        if not isinstance(key, str):
            return None
        entry = CacheEntry(cache_dir() / "profiles" / f"{key}.json", key, {})
        # Quiet: the normal path that follows a miss reports an unreadable entry once.
        profile = entry.load(quiet=True)
        return None if profile is None else (profile, chunks, entry.path)

    def store(self, reads: Reads, loaded: LoadedModel, chunks: int, entry: CacheEntry) -> None:
        """Records what ``reads`` saw and that ``chunks`` micro-batches led to the profile
        of ``entry``; keeps the profiles recorded for other counts when the reads are the
        same. A failure to write is silent: the profile cache itself reports one."""
        names = {str(loaded.path), *reads.files, *reads.modules}
        files = {}
        for name in sorted(names):
            state = _file_state(name) if _outside_installed(name) else None
            if state is not None:
                files[name] = state
        record: dict[str, Any] = {
            "key": self.key,
            "files": files,
            "distributions": _distribution_versions(),
            "environment": dict(sorted(reads.environment.items())),
            "batch_size": loaded.batch_size,
            "profiles": {},
        }
        old = self._read()
        same = old is not None and all(old.get(k) == record[k] for k in ("files", "batch_size"))
        if same and old is not None and isinstance(old.get("profiles"), dict):
            record["profiles"].update(old["profiles"])
        record["profiles"][str(chunks)] = entry.key
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, _KIND, record)
        except OSError:
            pass


def source_entry(args: argparse.Namespace, device: str) -> SourceIndex | None:
    """The index entry of ``args.model`` planned with ``args`` on ``device``; ``None``
    with ``--no-cache`` and for commands without that option."""
    import torch

    from autopipe.cli import cache

    if getattr(args, "no_cache", True):
        return None
    path = Path(args.model).resolve()
    # The versions the profile cache's key reads, as the modules state them.
    own = {"source": cache.own_source(), "version": cache.__version__, "torch": torch.__version__}
    key = _index_key(path, args, cache.device_identity(device), own)
    return SourceIndex(cache.cache_dir() / "sources" / f"{key}.json", key, args.chunks)
