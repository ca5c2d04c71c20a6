"""``--target``: plan for catalog devices the user does not have, from counted FLOPs and bytes."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from autopipe.cli.arguments import positive

if TYPE_CHECKING:
    from autopipe.planning import CatalogDevice, DeviceSpec, Efficiency
    from profiler import Profile

__all__: list[str] = []  # internal to the command line

# Nodes of the reference systems (DGX/HGX) hold 8 GPUs.
DEFAULT_PER_NODE = 8
# The catalog's peaks (autopipe.planning.hardware.catalog_entries.DTYPES), kept here so
# that building the parser imports no planning module.
PEAK_DTYPES = ("float32", "tf32", "bfloat16", "float16", "float8", "float64")


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """The options of planning for catalog devices."""
    group = parser.add_argument_group(
        "target", "plan for devices from the device catalog instead of measuring here"
    )
    group.add_argument(
        "--target",
        metavar="DEVICE",
        help="plan for this catalog device (h100, h200, a100-80gb, a100-40gb, l40s, mi300x, "
        "or one of --catalog): the layers are counted, not run (a model on the meta device "
        "works), and their times estimated from FLOPs and bytes",
    )
    group.add_argument(
        "--catalog",
        action="append",
        default=[],
        metavar="FILE.toml",
        help="a device catalog file of your own, adding or replacing devices (repeatable)",
    )
    group.add_argument(
        "--per-node",
        type=positive,
        metavar="N",
        help=f"devices per node with --target: links within a node use the device's "
        f"intra-node link, between nodes its inter-node link (default: {DEFAULT_PER_NODE})",
    )
    group.add_argument(
        "--peak-dtype",
        choices=PEAK_DTYPES,
        metavar="DTYPE",
        help="with --target: price the counted FLOPs at this dtype's peak ("
        + ", ".join(PEAK_DTYPES)
        + "; default: the --autocast dtype, else the model's); float8: linear GEMMs at "
        "the FP8 peak, attention at bfloat16 (Megatron's FP8 recipe), which needs the "
        "shard counts of --tp-plan to tell attention apart",
    )
    group.add_argument(
        "--fit",
        metavar="PROFILE.json",
        help="with --target: fit the estimate's efficiencies to this measured profile (made "
        "with counts by `autopipe profile` on a catalog device or the host CPU) and print "
        "the fit's error",
    )


def check_target_options(args: argparse.Namespace) -> CatalogDevice | None:
    """The ``--target`` device, found before any long work; ``None`` without it."""
    if args.target is None:
        options = (
            ("--per-node", args.per_node),
            ("--fit", args.fit),
            ("--peak-dtype", args.peak_dtype),
        )
        for option, given in options:
            if given:
                raise ValueError(f"{option} goes with --target DEVICE; add --target")
        if args.catalog:
            raise ValueError("--catalog goes with --target DEVICE; add --target")
        return None
    from autopipe.planning import find_device

    return find_device(args.target, extra=args.catalog)


def _fitted(args: argparse.Namespace, target: CatalogDevice) -> Efficiency | None:
    """The efficiencies fitted to ``--fit``'s measured profile, the fit printed on stderr."""
    if not args.fit:
        return None
    from autopipe.planning import find_device, fit_efficiency, measured_device
    from profiler import Profile

    measured = Profile.load(args.fit)
    try:
        device = find_device(measured.device_name or measured.device, extra=args.catalog)
    except ValueError:
        if not measured.device.startswith("cpu"):
            raise ValueError(
                f"--fit {args.fit}: its device {measured.device_name or measured.device!r} is "
                "not in the catalog; add it with --catalog FILE.toml"
            ) from None
        from profiler import measure_peaks

        # A CPU profile: this host's achievable peaks describe the device it was made on.
        device = measured_device(measure_peaks("cpu"), key="host")
    fit = fit_efficiency(measured, device)
    print(f"fit to {args.fit}: {fit.summary()}", file=sys.stderr)
    return fit.efficiency


def estimated(profile: Profile, args: argparse.Namespace, target: CatalogDevice) -> Profile:
    """The profile with times estimated for ``target``."""
    from autopipe.planning import estimate_profile

    return estimate_profile(
        profile, target, efficiency=_fitted(args, target), dtype=args.peak_dtype
    )


def target_devices(
    args: argparse.Namespace,
    target: CatalogDevice,
    stages: int,
    virtual: int,
    memory: int | list[int] | None,
) -> list[DeviceSpec]:
    """One device spec per stage: stage s on device ``s % stages``, links across nodes."""
    from autopipe.planning import catalog_devices

    per_node = args.per_node or DEFAULT_PER_NODE
    specs = catalog_devices(
        target, stages, per_node, memory=memory if isinstance(memory, int) else None
    )
    if isinstance(memory, list):
        specs = [replace(spec, memory=size) for spec, size in zip(specs, memory, strict=True)]
    return [specs[k % stages] for k in range(stages * virtual)]


def search_links(
    args: argparse.Namespace, target: CatalogDevice, devices: int
) -> tuple[float, float]:
    """The stage-to-stage and all-reduce bandwidths the search times with a target.

    Within one node both are the intra-node link. Across nodes a pipeline and a ring
    over several nodes each run at the slowest link they cross, the inter-node one: the
    search gives every configuration that rate (conservative for one that could keep a
    stage's replicas on one node).
    """
    per_node = args.per_node or DEFAULT_PER_NODE
    link = target.intra_node if devices <= per_node else target.inter_node
    return link.bandwidth, link.bandwidth
