"""Versioned JSON files written atomically, shared by profiles and plans."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_json"]

# A temporary file untouched this long was left by a killed writer (a write takes well
# under a second); younger ones may belong to a concurrent writer still at work.
_STALE_SECONDS = 60.0


def write_json(path: str | os.PathLike[str], kind: str, data: dict[str, Any]) -> None:
    """Writes ``data`` tagged with ``kind``; a failure leaves no half-written file.

    The text goes to a temporary file of its own in the target's folder and is renamed
    over the target once on disk, so concurrent writers to one path each leave a whole
    file (the last rename wins) and an interrupted write leaves the old file as it was.
    """
    target = Path(path)
    text = json.dumps({"kind": kind, **data}, indent=1)
    _sweep(target)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:  # name the target, not the hidden temporary file
        raise OSError(f"cannot write {kind} file {target}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        # mkstemp makes the file private (0600); give it the mode open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException as exc:  # KeyboardInterrupt too: no temporary file is left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OSError(f"cannot write {kind} file {target}: {exc.strerror}") from None
        raise


def _sweep(target: Path) -> None:
    """Removes the temporary files a killed write to ``target`` left behind."""
    now = time.time()
    with contextlib.suppress(OSError):
        for stale in target.parent.glob(f".{target.name}.*.tmp"):
            with contextlib.suppress(OSError):
                if now - stale.stat().st_mtime > _STALE_SECONDS:
                    stale.unlink()


def _umask() -> int:
    """The process's umask, read without changing it where the system can."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def read_json(path: str | os.PathLike[str], kind: str) -> dict[str, Any]:
    """Reads a file written by :func:`write_json` and checks its kind.

    Raises:
        ValueError: the file is missing, is not JSON or holds another kind of data.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {kind} file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; is it an autopipe {kind}?") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); is it an autopipe {kind}?") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise ValueError(f"{path} is not an autopipe {kind} file")
    del data["kind"]
    return data
