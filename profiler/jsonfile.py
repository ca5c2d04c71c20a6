"""Versioned JSON files written atomically, shared by profiles and plans."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_json"]


def write_json(path: str | os.PathLike[str], kind: str, data: dict[str, Any]) -> None:
    """Writes ``data`` tagged with ``kind``; a failure leaves no half-written file."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    try:
        tmp.write_text(json.dumps({"kind": kind, **data}, indent=1))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | os.PathLike[str], kind: str) -> dict[str, Any]:
    """Reads a file written by :func:`write_json` and checks its kind.

    Raises:
        ValueError: the file is missing, is not JSON or holds another kind of data.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {kind} file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); is it an autopipe {kind}?") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise ValueError(f"{path} is not an autopipe {kind} file")
    del data["kind"]
    return data
