"""Per-layer measurement of PyTorch models for pipeline planning.

The package's face: the names autopipe uses. Each loads its module on first use (the
data model, :class:`Profile`, imports no torch; the measuring functions load torch), so
the planner stays torch-free; :func:`lazy_face` is the helper every face loads with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from profiler.faces import lazy_face

if TYPE_CHECKING:
    from profiler.batch_sizes import default_batch_sizes, doubling_batch_sizes, smallest_batch
    from profiler.cache_folder import ENV_DIR, cache_dir
    from profiler.calibrate import measure_bandwidth, store_calibration
    from profiler.counting import fake_inputs, fake_state, quiet_fakes, swapped_state
    from profiler.devices import (
        cpu_model,
        default_device,
        gpu_count,
        physical_device,
        resolve_device,
        stage_devices,
        synchronize,
    )
    from profiler.expert_counts import ExpertCounts
    from profiler.expert_routing import assumed_tokens
    from profiler.fit import fit_linear, segments
    from profiler.in_context import calibrate_in_step, measure_compute_scale
    from profiler.jsonfile import read_json, write_json
    from profiler.layer import state_storages, storage_bytes, storage_key
    from profiler.layer_naming import layer_names, same_layer_name
    from profiler.live_memory import SavedMemory
    from profiler.materialize import materialize_part
    from profiler.measure import profile_layers, profile_model
    from profiler.memory_guard import MemoryShortage, format_bytes, storage_shortage
    from profiler.precision import (
        AUTOCAST_DTYPES,
        DTYPES,
        autocast_pass,
        cast_model,
        check_autocast,
        check_dtype,
        current_autocast,
    )
    from profiler.profile import PROFILE_VERSION, LayerProfile, Profile, TiedState
    from profiler.progress import TerminalProgress
    from profiler.roofline import measure_peaks
    from profiler.shard_counts import ShardCounts
    from profiler.tied import tensor_uses
    from profiler.tp_styles import SHARD_STYLES

__all__ = [
    "AUTOCAST_DTYPES",
    "DTYPES",
    "ENV_DIR",
    "PROFILE_VERSION",
    "SHARD_STYLES",
    "ExpertCounts",
    "LayerProfile",
    "MemoryShortage",
    "Profile",
    "SavedMemory",
    "ShardCounts",
    "TerminalProgress",
    "TiedState",
    "assumed_tokens",
    "autocast_pass",
    "cache_dir",
    "calibrate_in_step",
    "cast_model",
    "check_autocast",
    "check_dtype",
    "cpu_model",
    "current_autocast",
    "default_batch_sizes",
    "default_device",
    "doubling_batch_sizes",
    "fake_inputs",
    "fake_state",
    "fit_linear",
    "format_bytes",
    "gpu_count",
    "layer_names",
    "lazy_face",
    "materialize_part",
    "measure_bandwidth",
    "measure_compute_scale",
    "measure_peaks",
    "physical_device",
    "profile_layers",
    "profile_model",
    "quiet_fakes",
    "read_json",
    "resolve_device",
    "same_layer_name",
    "segments",
    "smallest_batch",
    "stage_devices",
    "state_storages",
    "storage_bytes",
    "storage_key",
    "storage_shortage",
    "store_calibration",
    "swapped_state",
    "synchronize",
    "tensor_uses",
    "write_json",
]

_HOMES = {
    "AUTOCAST_DTYPES": "profiler.precision",
    "DTYPES": "profiler.precision",
    "ENV_DIR": "profiler.cache_folder",
    "PROFILE_VERSION": "profiler.profile",
    "SHARD_STYLES": "profiler.tp_styles",
    "LayerProfile": "profiler.profile",
    "MemoryShortage": "profiler.memory_guard",
    "Profile": "profiler.profile",
    "SavedMemory": "profiler.live_memory",
    "ShardCounts": "profiler.shard_counts",
    "ExpertCounts": "profiler.expert_counts",
    "TerminalProgress": "profiler.progress",
    "TiedState": "profiler.profile",
    "assumed_tokens": "profiler.expert_routing",
    "autocast_pass": "profiler.precision",
    "cache_dir": "profiler.cache_folder",
    "calibrate_in_step": "profiler.in_context",
    "cast_model": "profiler.precision",
    "check_autocast": "profiler.precision",
    "check_dtype": "profiler.precision",
    "cpu_model": "profiler.devices",
    "current_autocast": "profiler.precision",
    "default_batch_sizes": "profiler.batch_sizes",
    "default_device": "profiler.devices",
    "doubling_batch_sizes": "profiler.batch_sizes",
    "fake_inputs": "profiler.counting",
    "fake_state": "profiler.counting",
    "fit_linear": "profiler.fit",
    "format_bytes": "profiler.memory_guard",
    "gpu_count": "profiler.devices",
    "layer_names": "profiler.layer_naming",
    "materialize_part": "profiler.materialize",
    "measure_bandwidth": "profiler.calibrate",
    "measure_compute_scale": "profiler.in_context",
    "measure_peaks": "profiler.roofline",
    "physical_device": "profiler.devices",
    "profile_layers": "profiler.measure",
    "profile_model": "profiler.measure",
    "quiet_fakes": "profiler.counting",
    "read_json": "profiler.jsonfile",
    "resolve_device": "profiler.devices",
    "same_layer_name": "profiler.layer_naming",
    "segments": "profiler.fit",
    "smallest_batch": "profiler.batch_sizes",
    "stage_devices": "profiler.devices",
    "state_storages": "profiler.layer",
    "storage_bytes": "profiler.layer",
    "storage_key": "profiler.layer",
    "storage_shortage": "profiler.memory_guard",
    "store_calibration": "profiler.calibrate",
    "swapped_state": "profiler.counting",
    "synchronize": "profiler.devices",
    "tensor_uses": "profiler.tied",
    "write_json": "profiler.jsonfile",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
