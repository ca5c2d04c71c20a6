"""Fits a device's catalog entry to profiles measured on it, and checks counted bytes there.

For each model (examples/gpt2.py and examples/mlp.py), the layers are profiled on the device
with their counts; the report gives, per model, the units whose counted bytes differ from
the measured ones (a device's own kernels: fused attention saves other tensors) and the
efficiencies fitted to the measured times with the fit's error. The device's catalog entry
is found by its name (``torch.cuda.get_device_name``); a CPU is described by its measured
peaks.

Run: ``python -m benchmarks.planning.fit_device [--device cuda:0] [--out DIR] [--quick]``;
writes ``fit_<device>.json`` and ``fit_<device>.md`` to ``--out`` (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autopipe.cli.model_file import load_split  # noqa: E402
from autopipe.planning.hardware.device_catalog import CatalogDevice, find_device, measured_device  # noqa: E402
from autopipe.planning.hardware.estimates import fit_efficiency  # noqa: E402
from profiler.measure import profile_model  # noqa: E402
from profiler.profile import Profile  # noqa: E402

MODELS = {"gpt2": ROOT / "examples" / "gpt2.py", "mlp": ROOT / "examples" / "mlp.py"}
BYTES = ("saved", "output", "shared")


def _device_entry(device: str) -> CatalogDevice:
    import torch

    if device.startswith("cuda"):
        return find_device(torch.cuda.get_device_name(torch.device(device)))
    from profiler.roofline import measure_peaks

    return measured_device(measure_peaks(device), key="host")


def _byte_differences(counted: Profile, measured: Profile) -> list[dict[str, Any]]:
    out = []
    for ours, theirs in zip(counted.layers, measured.layers, strict=True):
        for what in BYTES:
            a, b = getattr(ours, what), getattr(theirs, what)
            if a != b:
                out.append({"unit": ours.name, "figure": what, "counted": a, "measured": b})
    return out


def fit_model(name: str, device: str, entry: CatalogDevice, quick: bool) -> dict[str, Any]:
    """Profiles one model on ``device`` (measured and counted) and fits ``entry`` to it."""
    owner, layers, sample = load_split(MODELS[name])
    repeats = {"warmup": 1, "repeats": 2} if quick else {"warmup": 2, "repeats": 10}
    measured = profile_model(layers, sample, device=device, chunks=4, owner=owner, **repeats)
    counted = profile_model(layers, sample, device=device, chunks=4, owner=owner, measure=False)
    fit = fit_efficiency(measured, entry)
    return {
        "units": len(measured.layers),
        "byte_differences": _byte_differences(counted, measured),
        "fit": fit.summary(),
        "efficiency": fit.efficiency.to_dict(),
        "median_error": fit.median_error,
        "max_error": fit.max_error,
        "units_seconds": [
            {"unit": f.name, "measured": f.measured, "estimated": f.estimated, "error": f.error}
            for f in fit.layers
        ],
    }


def render(device: str, entry: CatalogDevice, results: dict[str, dict[str, Any]]) -> str:
    lines = [f"# Catalog fit on {device} ({entry.name}, entry `{entry.key}`)", ""]
    lines += ["| model | units | fit | counted ≠ measured bytes |", "|---|---:|---|---|"]
    for name, r in results.items():
        diffs = ", ".join(f"{d['unit']} {d['figure']}" for d in r["byte_differences"]) or "none"
        lines.append(f"| {name} | {r['units']} | {r['fit']} | {diffs} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
    args = parser.parse_args()
    entry = _device_entry(args.device)
    results = {}
    for name in args.models.split(","):
        print(f"profiling {name} on {args.device} ...", file=sys.stderr, flush=True)
        results[name] = fit_model(name, args.device, entry, args.quick)
    tag = args.device.replace(":", "")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"device": args.device, "entry": entry.key, "models": results}
    (args.out / f"fit_{tag}.json").write_text(json.dumps(record, indent=2))
    text = render(args.device, entry, results)
    (args.out / f"fit_{tag}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
