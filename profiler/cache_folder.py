"""The folder autopipe keeps what it measured once per machine in (profiles, calibration)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_DIR", "cache_dir"]

ENV_DIR = "AUTOPIPE_CACHE_DIR"


def cache_dir() -> Path:
    """``$AUTOPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopipe``, else ``~/.cache/autopipe``."""
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG rule: a relative path is invalid and ignored.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "autopipe"
