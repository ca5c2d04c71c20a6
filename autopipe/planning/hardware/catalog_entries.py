"""The entries of a device catalog file: their data classes and their checks."""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

__all__: list[str] = []

# The dtypes a peak may be given for; ``tf32`` is float32 matmuls on tensor cores, and
# ``float64`` the FP64 tensor-core peak where there is one (see device_catalog.toml).
DTYPES = ("float32", "tf32", "bfloat16", "float16", "float8", "float64")
_REQUIRED = ("name", "memory", "memory_bandwidth", "peak_flops", "intra_node", "inter_node")
_OPTIONAL = ("aliases", "sources")
_LINK = ("bandwidth", "latency")
_SOURCE = ("document", "url", "figures")
# What a source may say it gives: a device's figures, by their place in the table.
FIGURES = (
    "memory",
    "memory_bandwidth",
    "peak_flops",
    *(f"peak_flops.{d}" for d in DTYPES),
    *(f"{link}.{what}" for link in ("intra_node", "inter_node") for what in _LINK),
)


@dataclass(frozen=True)
class Link:
    """A link between two devices.

    Attributes:
        bandwidth: bytes per second in one direction, per device.
        latency: fixed seconds per message.
    """

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Source:
    """A document some of a device's figures come from.

    Attributes:
        document: the document's name (e.g. the vendor's datasheet).
        url: where it is published.
        figures: the figures it gives, e.g. ``memory`` or ``peak_flops``.
    """

    document: str
    url: str
    figures: tuple[str, ...]


@dataclass(frozen=True)
class CatalogDevice:
    """One kind of device: its memory, its peaks and the links of a node of them.

    Attributes:
        key: its catalog name, lower case (e.g. ``h100``).
        name: its display name.
        aliases: other names it is found by, lower case.
        memory: capacity in bytes.
        memory_bandwidth: bytes per second of its memory.
        peak_flops: dense peak FLOP/s per dtype name (see :data:`DTYPES`).
        intra_node: the link to another device of the same node.
        inter_node: the link to a device of another node.
        sources: where the figures come from.
    """

    key: str
    name: str
    memory: int
    memory_bandwidth: float
    peak_flops: Mapping[str, float] = field(hash=False)
    intra_node: Link
    inter_node: Link
    aliases: tuple[str, ...] = ()
    sources: tuple[Source, ...] = ()

    def peak(self, dtype: str) -> float:
        """The dense peak FLOP/s in ``dtype``.

        Raises:
            ValueError: the catalog gives no peak for ``dtype`` on this device.
        """
        if dtype not in self.peak_flops:
            raise ValueError(
                f"device {self.key} ({self.name}) has no {dtype} peak in the catalog (it has "
                f"{', '.join(self.peak_flops)}); add peak_flops.{dtype} in a catalog file"
            )
        return self.peak_flops[dtype]


def number(value: object, where: str, positive: bool = True) -> float:
    """``value`` as a float: a finite number > 0 (``>= 0`` unless ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where} is {value!r}; it must be a number, not a {type(value).__name__}")
    number = float(value)
    bound = "> 0" if positive else ">= 0"
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{where} is {value!r}; it must be a finite number {bound}")
    return number


def checked_table(value: object, where: str, known: Sequence[str], required: Sequence[str]) -> dict:
    """``value``, a table with the ``required`` fields and no field outside ``known``."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is {value!r}; it must be a table")
    for name in value:
        if name not in known:
            raise ValueError(f"{where} has unknown field {name!r}; known: {', '.join(known)}")
    for name in required:
        if name not in value:
            raise ValueError(f"{where} lacks field {name!r}")
    return value


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise ValueError(f"{where} is {value!r}; it must be a list of non-empty strings")
    return tuple(value)


def _link(value: object, where: str) -> Link:
    table = checked_table(value, where, _LINK, _LINK)
    bandwidth = number(table["bandwidth"], f"{where}.bandwidth")
    return Link(bandwidth, number(table["latency"], f"{where}.latency", positive=False))


def _source(value: object, where: str) -> Source:
    table = checked_table(value, where, _SOURCE, _SOURCE)
    for what in ("document", "url"):
        if not isinstance(table[what], str) or not table[what]:
            raise ValueError(f"{where}.{what} is {table[what]!r}; it must be a non-empty string")
    figures = _strings(table["figures"], f"{where}.figures")
    for figure in figures:
        if figure not in FIGURES:
            raise ValueError(f"{where}.figures names {figure!r}; known: {', '.join(FIGURES)}")
    return Source(table["document"], table["url"], figures)


def _device(key: str, value: object) -> CatalogDevice:
    """The device of one catalog table; errors name the key and the field."""
    where = f"device {key!r}"
    table = checked_table(value, where, (*_REQUIRED, *_OPTIONAL), _REQUIRED)
    if not isinstance(table["name"], str) or not table["name"]:
        raise ValueError(f"{where}: name is {table['name']!r}; it must be a non-empty string")
    peaks = checked_table(table["peak_flops"], f"{where}: peak_flops", DTYPES, ())
    if not peaks:
        raise ValueError(f"{where}: peak_flops is empty; give at least one of {', '.join(DTYPES)}")
    memory = number(table["memory"], f"{where}: memory")
    sources = table.get("sources", [])
    if not isinstance(sources, list):
        raise ValueError(f"{where}: sources is {sources!r}; it must be a list of tables")
    return CatalogDevice(
        key=key.lower(),
        name=table["name"],
        memory=round(memory),
        memory_bandwidth=number(table["memory_bandwidth"], f"{where}: memory_bandwidth"),
        peak_flops={d: number(v, f"{where}: peak_flops.{d}") for d, v in peaks.items()},
        intra_node=_link(table["intra_node"], f"{where}: intra_node"),
        inter_node=_link(table["inter_node"], f"{where}: inter_node"),
        aliases=tuple(a.lower() for a in _strings(table.get("aliases", []), f"{where}: aliases")),
        sources=tuple(_source(s, f"{where}: sources[{i}]") for i, s in enumerate(sources)),
    )


def read_catalog(path: str | os.PathLike[str]) -> dict[str, CatalogDevice]:
    """The devices of one catalog file; any error names the file."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the catalog file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib lets the codec's error out
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); save the catalog file as UTF-8"
        ) from None
    try:
        devices = [_device(key, value) for key, value in data.items()]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    found: dict[str, CatalogDevice] = {}
    for device in devices:
        if found.setdefault(device.key, device) is not device:  # keys differ only in case
            raise ValueError(f"{path}: device {device.key!r} is given twice; keep one table")
    return found
