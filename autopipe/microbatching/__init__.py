"""What both runners need so that micro-batches train like the whole mini-batch."""

from __future__ import annotations

from autopipe.microbatching.batchnorm import DeferredBatchNorm

__all__ = ["DeferredBatchNorm"]
