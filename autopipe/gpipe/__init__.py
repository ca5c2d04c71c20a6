"""The single-process GPipe executor, and any module wrapped into one.

Each name below loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe.gpipe.executor_calibration import calibrate_executor
    from autopipe.gpipe.gpipe import GPipe, verify_module
    from autopipe.gpipe.split_bench import time_splits
    from autopipe.gpipe.wrapped import WrappedPipeline
    from autopipe.gpipe.wrapping import wrap

__all__ = [
    "GPipe",
    "WrappedPipeline",
    "calibrate_executor",
    "time_splits",
    "verify_module",
    "wrap",
]

_HOMES = {
    "GPipe": "autopipe.gpipe.gpipe",
    "WrappedPipeline": "autopipe.gpipe.wrapped",
    "calibrate_executor": "autopipe.gpipe.executor_calibration",
    "time_splits": "autopipe.gpipe.split_bench",
    "verify_module": "autopipe.gpipe.gpipe",
    "wrap": "autopipe.gpipe.wrapping",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
