"""A catalog of devices by their spec-sheet figures, to plan for devices one does not own."""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autopipe.planning.hardware.catalog_entries import (
    DTYPES,
    CatalogDevice,
    Link,
    Source,
    checked_table,
    number,
    read_catalog,
)
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.quantities import parse_bytes

__all__ = [
    "CatalogDevice",
    "Source",
    "catalog_devices",
    "find_device",
    "load_catalog",
    "measured_device",
]

BUNDLED = Path(__file__).with_name("device_catalog.toml")


def _names(devices: Mapping[str, CatalogDevice], origin: Mapping[str, str]) -> dict[str, str]:
    """Every name a device is found by, to its key; a name used twice is refused."""
    names: dict[str, str] = {}
    for key, device in devices.items():
        for name in (key, *device.aliases):
            other = names.setdefault(name, key)
            if other != key:
                raise ValueError(
                    f"{origin[key]}: device {key!r} is also called {name!r}, a name of "
                    f"device {other!r} ({origin[other]}); rename one of them"
                )
    return names


def load_catalog(extra: Sequence[str | os.PathLike[str]] = ()) -> dict[str, CatalogDevice]:
    """The bundled device catalog, with the devices of the user's catalog files.

    Args:
        extra: TOML files of the bundled catalog's form (see ``device_catalog.toml``), read
            in order; a device whose key is already known replaces that device.

    Returns:
        The devices by key.

    Raises:
        ValueError: a file cannot be read or has a bad entry; the one-line message names
            the file, the device and the field.
    """
    if isinstance(extra, (str, os.PathLike)):
        extra = [extra]
    devices: dict[str, CatalogDevice] = {}
    origin: dict[str, str] = {}
    for path in (BUNDLED, *extra):
        for key, device in read_catalog(path).items():
            devices[key] = device
            origin[key] = str(path)
    _names(devices, origin)
    return devices


def find_device(name: str, extra: Sequence[str | os.PathLike[str]] = ()) -> CatalogDevice:
    """A catalog device by its key or one of its aliases, in any case.

    Args:
        name: e.g. ``h100`` or ``H100-SXM``.
        extra: the user's catalog files (see :func:`load_catalog`).

    Raises:
        ValueError: no device is called ``name``; the message lists the known keys.
    """
    devices = load_catalog(extra)
    names = _names(devices, dict.fromkeys(devices, "catalog"))
    key = names.get(str(name).strip().lower())
    if key is None:
        raise ValueError(
            f"unknown device {name!r}; known: {', '.join(sorted(devices))} (or describe it "
            "in a catalog file of the same form as autopipe/planning/hardware/device_catalog.toml)"
        )
    return devices[key]


def catalog_devices(
    device: CatalogDevice,
    count: int,
    per_node: int | None = None,
    *,
    memory: int | str | None = None,
) -> list[DeviceSpec]:
    """The planner's devices for a pipeline of ``count`` catalog devices.

    Device ``k``'s link is its link to device ``k + 1`` (the last one's to device 0,
    the link interleaved schedules wrap around on): intra-node when both are on one node
    of ``per_node`` devices (devices ``0..per_node-1`` on the first), else inter-node.

    Args:
        device: the kind of device.
        count: devices in the pipeline.
        per_node: devices per node; ``None``: all on one node.
        memory: capacity per device (bytes or a size such as ``75GiB``); default: the
            catalog's.

    Raises:
        ValueError: ``count`` or ``per_node`` is not an integer >= 1.
    """
    for what, value in (("count", count), ("per_node", per_node)):
        bad = not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1
        if bad and not (what == "per_node" and value is None):
            raise ValueError(f"{what} is {value!r}; it must be an integer >= 1")
    node = count if per_node is None else int(per_node)
    capacity = device.memory if memory is None else parse_bytes(memory)
    out = []
    for k in range(count):
        nxt = (k + 1) % count
        link = device.intra_node if k // node == nxt // node else device.inter_node
        out.append(
            DeviceSpec(
                name=f"{device.key}:{k}",
                memory=capacity,
                bandwidth=link.bandwidth,
                latency=link.latency,
            )
        )
    return out


def measured_device(
    figures: Mapping[str, Any],
    *,
    key: str = "host",
    name: str | None = None,
    intra_node: Link | None = None,
    inter_node: Link | None = None,
) -> CatalogDevice:
    """A catalog device from measured figures, e.g. the host CPU's.

    Args:
        figures: what :func:`profiler.roofline.measure_peaks` returns: ``peak_flops``
            (FLOP/s per dtype), ``memory_bandwidth`` (bytes/s), ``memory`` (bytes) and
            optionally ``name``.
        key: the device's catalog name.
        name: its display name; default: ``figures["name"]``, else the key.
        intra_node: the link between two such devices; default: a memory copy at half
            the measured bandwidth (each byte is read and written), 10 µs per message.
        inter_node: the link between hosts; default: 100 Gb/s Ethernet, 50 µs per message.

    Raises:
        ValueError: a figure is missing, not a number, or not finite and positive.
    """
    where = f"measured device {key!r}"
    table = checked_table(
        dict(figures),
        where,
        ("peak_flops", "memory_bandwidth", "memory", "name", "device"),
        ("peak_flops", "memory_bandwidth", "memory"),
    )
    bandwidth = number(table["memory_bandwidth"], f"{where}: memory_bandwidth")
    peaks = checked_table(dict(table["peak_flops"]), f"{where}: peak_flops", DTYPES, ())
    if not peaks:
        raise ValueError(f"{where}: peak_flops is empty; measure at least one dtype")
    return CatalogDevice(
        key=key.lower(),
        name=name or str(table.get("name") or key),
        memory=round(number(table["memory"], f"{where}: memory")),
        memory_bandwidth=bandwidth,
        peak_flops={d: number(v, f"{where}: peak_flops.{d}") for d, v in peaks.items()},
        intra_node=intra_node or Link(bandwidth / 2, 10e-6),
        inter_node=inter_node or Link(12.5e9, 50e-6),
    )
