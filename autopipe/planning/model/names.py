"""The names plans, runners and the command line share: checkpoint modes, schedules, strategies."""

from __future__ import annotations

__all__ = [
    "ALL_SCHEDULES",
    "CHECKPOINT_MODES",
    "FIXED_CHECKPOINT_MODES",
    "SCHEDULES",
    "SEARCH_CHECKPOINTS",
    "STRATEGIES",
    "V_SCHEDULES",
]

# The modes a stage can checkpoint by, fastest first; ``auto`` chooses from the first two.
FIXED_CHECKPOINT_MODES = ("never", "except_last", "always")
# The modes a plan can be asked for: a fixed one, or ``auto`` (each stage checkpoints only
# if it does not fit otherwise).
CHECKPOINT_MODES = ("always", "except_last", "never", "auto")
# The modes :func:`autopipe.search` weighs unless told.
SEARCH_CHECKPOINTS = (*FIXED_CHECKPOINT_MODES, "auto")

# The schedules both runners execute and the search weighs.
SCHEDULES = ("gpipe", "1f1b")
# Every schedule a plan can be made for: ``zb`` (torch's ScheduleInterleavedZeroBubble)
# runs on the distributed runner only and is valued by its replayed order.
# ``zbv`` and ``dualpipev`` (torch's ScheduleZBVZeroBubble and ScheduleDualPipeV) hold two
# stages per rank in the V placement (rank r: stages r and 2K−1−r); distributed runner only.
V_SCHEDULES = ("zbv", "dualpipev")
ALL_SCHEDULES = (*SCHEDULES, "zb", *V_SCHEDULES)

# How :func:`autopipe.plan` may choose a split: exact, or a peer's, computed as the peer
# does (``torchtitan`` only for decoder-only models).
STRATEGIES = ("optimal", "uniform", "parameters", "blockpartition", "torchtitan")
