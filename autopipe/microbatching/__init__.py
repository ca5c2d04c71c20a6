"""What both runners need so that micro-batches train like the whole mini-batch.

Each name below loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe.microbatching.assembly import Assembly, Layers, assemble
    from autopipe.microbatching.batchnorm import DeferredBatchNorm, resolve_deferred
    from autopipe.microbatching.batchnorm_units import defer_layers
    from autopipe.microbatching.buffer_snapshot import BufferSnapshot, per_micro_batch_writes
    from autopipe.microbatching.recomputation import (
        checkpointing,
        is_checkpointing,
        is_recomputing,
        recomputing,
    )
    from autopipe.microbatching.step_timing import (
        Progress,
        check_steps,
        kept_warmup_rounds,
        mean_output_loss,
        median_seconds,
        take_turns,
        tiny_stages,
        turn_order,
    )

__all__ = [
    "Assembly",
    "BufferSnapshot",
    "DeferredBatchNorm",
    "Layers",
    "Progress",
    "assemble",
    "check_steps",
    "checkpointing",
    "defer_layers",
    "is_checkpointing",
    "is_recomputing",
    "kept_warmup_rounds",
    "mean_output_loss",
    "median_seconds",
    "per_micro_batch_writes",
    "recomputing",
    "resolve_deferred",
    "take_turns",
    "tiny_stages",
    "turn_order",
]

_HOMES = {
    "Assembly": "autopipe.microbatching.assembly",
    "BufferSnapshot": "autopipe.microbatching.buffer_snapshot",
    "DeferredBatchNorm": "autopipe.microbatching.batchnorm",
    "Layers": "autopipe.microbatching.assembly",
    "Progress": "autopipe.microbatching.step_timing",
    "assemble": "autopipe.microbatching.assembly",
    "check_steps": "autopipe.microbatching.step_timing",
    "checkpointing": "autopipe.microbatching.recomputation",
    "defer_layers": "autopipe.microbatching.batchnorm_units",
    "is_checkpointing": "autopipe.microbatching.recomputation",
    "is_recomputing": "autopipe.microbatching.recomputation",
    "kept_warmup_rounds": "autopipe.microbatching.step_timing",
    "mean_output_loss": "autopipe.microbatching.step_timing",
    "median_seconds": "autopipe.microbatching.step_timing",
    "per_micro_batch_writes": "autopipe.microbatching.buffer_snapshot",
    "recomputing": "autopipe.microbatching.recomputation",
    "resolve_deferred": "autopipe.microbatching.batchnorm",
    "take_turns": "autopipe.microbatching.step_timing",
    "tiny_stages": "autopipe.microbatching.step_timing",
    "turn_order": "autopipe.microbatching.step_timing",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
