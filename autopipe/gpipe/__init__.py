"""The single-process GPipe executor, and any module wrapped into one."""

from __future__ import annotations

from autopipe.gpipe.gpipe import GPipe, verify_module
from autopipe.gpipe.wrapped import WrappedPipeline
from autopipe.gpipe.wrapping import wrap

__all__ = ["GPipe", "WrappedPipeline", "verify_module", "wrap"]
