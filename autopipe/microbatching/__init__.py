"""What both runners need so that micro-batches train like the whole mini-batch."""

from __future__ import annotations

from autopipe.microbatching.batchnorm import DeferredBatchNorm, resolve_deferred
from autopipe.microbatching.batchnorm_units import defer_layers
from autopipe.microbatching.recomputation import (
    checkpointing,
    is_checkpointing,
    is_recomputing,
    recomputing,
)

__all__ = [
    "DeferredBatchNorm",
    "checkpointing",
    "defer_layers",
    "is_checkpointing",
    "is_recomputing",
    "recomputing",
    "resolve_deferred",
]
