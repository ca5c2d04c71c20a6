"""The distributed runner on ``torch.distributed.pipelining``: stages, replicas, calibration.

Each name below loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe.distributed.calibration import calibrate_ranks
    from autopipe.distributed.calibration_cache import (
        apply_runner_calibration,
        cache_file,
        cached_runner_calibration,
        runtime_key,
        save_runner_calibration,
    )
    from autopipe.distributed.cpu_binding import cpu_share
    from autopipe.distributed.distributed_pipeline import (
        SCHEDULES,
        DistributedPipeline,
        init_distributed,
        merge_state_dicts,
    )
    from autopipe.distributed.rank_bench import time_splits_on_ranks
    from autopipe.distributed.rank_conditions import (
        calibrate_local_ranks,
        profile_on_local_ranks,
        with_rank_times,
    )

__all__ = [
    "SCHEDULES",
    "DistributedPipeline",
    "apply_runner_calibration",
    "cache_file",
    "cached_runner_calibration",
    "calibrate_local_ranks",
    "calibrate_ranks",
    "cpu_share",
    "init_distributed",
    "merge_state_dicts",
    "profile_on_local_ranks",
    "runtime_key",
    "save_runner_calibration",
    "time_splits_on_ranks",
    "with_rank_times",
]

_HOMES = {
    "SCHEDULES": "autopipe.distributed.distributed_pipeline",
    "DistributedPipeline": "autopipe.distributed.distributed_pipeline",
    "apply_runner_calibration": "autopipe.distributed.calibration_cache",
    "cache_file": "autopipe.distributed.calibration_cache",
    "cached_runner_calibration": "autopipe.distributed.calibration_cache",
    "calibrate_local_ranks": "autopipe.distributed.rank_conditions",
    "calibrate_ranks": "autopipe.distributed.calibration",
    "cpu_share": "autopipe.distributed.cpu_binding",
    "init_distributed": "autopipe.distributed.distributed_pipeline",
    "merge_state_dicts": "autopipe.distributed.distributed_pipeline",
    "profile_on_local_ranks": "autopipe.distributed.rank_conditions",
    "runtime_key": "autopipe.distributed.calibration_cache",
    "save_runner_calibration": "autopipe.distributed.calibration_cache",
    "time_splits_on_ranks": "autopipe.distributed.rank_bench",
    "with_rank_times": "autopipe.distributed.rank_conditions",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
