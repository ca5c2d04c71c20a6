"""The distributed runner on ``torch.distributed.pipelining``: stages, replicas, calibration."""

from __future__ import annotations

from autopipe.distributed.calibration import calibrate_ranks
from autopipe.distributed.distributed_pipeline import (
    SCHEDULES,
    DistributedPipeline,
    init_distributed,
    merge_state_dicts,
)

__all__ = [
    "SCHEDULES",
    "DistributedPipeline",
    "calibrate_ranks",
    "init_distributed",
    "merge_state_dicts",
]
