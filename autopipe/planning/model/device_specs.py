"""Descriptions of the devices a pipeline's stages run on."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autopipe.planning.model.quantities import parse_bytes, parse_rate

__all__ = ["DeviceSpec", "make_devices"]


@dataclass(frozen=True)
class DeviceSpec:
    """One pipeline device as the planner sees it.

    Attributes:
        name: where the stage runs, e.g. ``cuda:0`` or ``cpu``.
        memory: capacity in bytes (or a size such as ``16GiB``), or ``None`` for unlimited.
        speed: relative speed; a stage's compute time is divided by it.
        bandwidth: bytes per second of the link to the next stage's device (or a rate such
            as ``10GB/s``), or ``None`` to treat transfers as free.
        latency: fixed seconds of each message to the next stage's device (per micro-batch
            and direction), on top of ``bytes / bandwidth``.
    """

    name: str = "cpu"
    memory: int | None = None
    speed: float = 1.0
    bandwidth: float | None = None
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"a device name must be a string such as 'cuda:0', got {self.name!r}")
        # Frozen: normalized values go in through object.__setattr__.
        if self.memory is not None:
            object.__setattr__(self, "memory", self._parsed(parse_bytes, self.memory))
        if self.bandwidth is not None:
            object.__setattr__(self, "bandwidth", self._parsed(parse_rate, self.bandwidth))
        for what, value in (("speed", self.speed), ("latency", self.latency)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"device {self.name}: {what} must be a number, got {value!r}")
            object.__setattr__(self, what, float(value))
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"device {self.name}: speed must be > 0, got {self.speed}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"device {self.name}: latency must be >= 0, got {self.latency}")

    def _parsed(self, parse: Callable[[Any], Any], value: Any) -> Any:
        try:
            return parse(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"device {self.name}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        return cls(**data)


def _named(device: object) -> DeviceSpec:
    if not isinstance(device, str):
        raise TypeError(f"a device must be a DeviceSpec or a device name, got {device!r}")
    return DeviceSpec(name=device)


def _per_device(value: Any, count: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{what} has {len(value)} entries but there are {count} devices")
        return list(value)
    return [value] * count


def make_devices(
    devices: int | Sequence[DeviceSpec | str],
    *,
    memory: int | str | Sequence[int | str | None] | None = None,
    speed: float | Sequence[float] | None = None,
    bandwidth: float | None = None,
    name: str = "cpu",
    latency: float | None = None,
) -> list[DeviceSpec]:
    """Builds the device list the planner works on.

    Args:
        devices: a device count (identical devices named ``name``), or a list of
            :class:`DeviceSpec` or device names.
        memory: capacity per device: one size for all, or one per device (bytes or
            strings such as ``16GiB``). Fills in devices that have no capacity of their own.
        speed: relative speed for all devices or one per device.
        bandwidth: link bandwidth in bytes/s for devices that have none.
        name: device name used when ``devices`` is a count.
        latency: seconds per message to the next stage for devices that have none.
    """
    if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"need at least one stage, got {devices}")
        specs = [DeviceSpec(name=name) for _ in range(int(devices))]
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        specs = [d if isinstance(d, DeviceSpec) else _named(d) for d in devices]
        if not specs:
            raise ValueError("need at least one device")
    else:
        raise TypeError(
            f"devices must be a stage count or a list of DeviceSpec or device names such as "
            f"['cuda:0', 'cuda:1'], got {devices!r}"
        )
    count = len(specs)
    memories = _per_device(memory, count, "memory")
    speeds = _per_device(speed, count, "speed")
    out = []
    for spec, mem, spd in zip(specs, memories, speeds):
        out.append(
            DeviceSpec(
                name=spec.name,
                memory=spec.memory if mem is None else parse_bytes(mem),
                speed=spec.speed if spd is None else spd,
                bandwidth=spec.bandwidth if spec.bandwidth is not None else bandwidth,
                latency=spec.latency or (latency or 0.0),
            )
        )
    return out
