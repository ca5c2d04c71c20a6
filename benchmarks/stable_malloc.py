"""Re-runs a benchmark with glibc malloc keeping freed memory, for repeatable CPU timings.

glibc's malloc hands large freed blocks back to the OS and page-faults them in again on
the next step, by an amount that depends on the process's history; that alone moved a
step of the same plan by up to 40% between runs. With ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` raised, freed memory stays in the process, as a caching
allocator (CUDA's, jemalloc, tcmalloc) keeps it. Child processes inherit the setting.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["MALLOC", "rerun_with_stable_malloc"]

MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
ROOT = Path(__file__).resolve().parents[1]


def rerun_with_stable_malloc(module: str) -> None:
    """Replaces this process by ``python -m module <same arguments>`` with :data:`MALLOC`
    set, unless it is set already (then returns)."""
    if all(os.environ.get(key) == value for key, value in MALLOC.items()):
        return
    os.chdir(ROOT)
    command = [sys.executable, "-m", module, *sys.argv[1:]]
    os.execve(sys.executable, command, {**os.environ, **MALLOC})
