"""A torchtitan 0.3.0 config registry of the sections the torchtitan export writes.

torchtitan 0.3.0 builds its config from a registry function (``--module M --config F``)
and command-line overrides. Its models' registries need the whole trainer (triton,
torchdata); this one holds torchtitan's own ``TrainingConfig``, ``ParallelismConfig``
and activation checkpointing policy, the sections the export writes, and the
``hf_assets_path`` that ``ConfigManager`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import (
    ActivationCheckpointingConfig,
    SelectiveAC,
)


@dataclass(kw_only=True)
class PlanConfig:
    """The trainer config's sections that a plan sets, with torchtitan's defaults."""

    hf_assets_path: str = "."
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointingConfig = field(default_factory=SelectiveAC.Config)


def plan_config() -> PlanConfig:
    """The registry function: torchtitan's defaults, which the overrides then set."""
    return PlanConfig()
