"""Predicted vs measured step time and peak memory of the plans ``autopipe.search`` ranks.

For each bundled example (examples/mlp.py, examples/convnet.py; ``--examples gpt2`` adds
the Hugging Face GPT-2 example, traced into units, on one device) on this machine's CPU,
one thread per process:

1. profile the layers at micro-batch sizes spanning the search's range, and calibrate
   (executor overhead, and the whole model's steps at several M against the profile,
   which scales the layers' per-micro-batch and per-sample times);
2. one device: ``search(profile, devices=1)`` ranks micro-batch counts and checkpoint
   modes under the GPipe schedule; every ranked configuration runs on the GPipe executor;
3. two devices: ``search(profile, devices=2)`` ranks K·D <= 2 (pipelines of two stages,
   two data-parallel replicas, one device) with both schedules; each runs on the
   distributed runner, two gloo ranks (one-device plans on the GPipe executor), after
   the ranks measured their link and all-reduce (see benchmarks/accuracy/two_ranks.py).

Step time is forward + backward of one mini-batch (optimizer step excluded, as in the
planner), the median of interleaved repeats. Memory per stage is parameters, gradients,
Adam state and buffers counted from the tensors, plus the peak of the bytes autograd holds
for backward (profiler.live_memory), against the plan's per-stage prediction. The search's
first choice is compared with the fastest configuration measured. Results go to
benchmarks/results/accuracy.{json,md}.

The benchmark re-runs itself with glibc malloc keeping freed memory (see
benchmarks/processes.py), so that a step's time does not depend on the process's history.

Usage: python -m benchmarks.accuracy.ranked_plans [--repeats 15] [--top 6]
[--examples mlp convnet gpt2] [--out DIR] [--stem NAME]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autopipe import GPipe, search  # noqa: E402
from autopipe.cli.model_file import load_sequential  # noqa: E402
from autopipe.gpipe.executor_calibration import measure_overhead  # noqa: E402
from autopipe.planning.model.plans import Plan  # noqa: E402
from benchmarks.accuracy.measure import (  # noqa: E402
    compare,
    distinct,
    interleaved_medians,
    stage_memory,
    timed,
)
from benchmarks.accuracy.report import write_report  # noqa: E402
from benchmarks.accuracy.runs import combine  # noqa: E402
from benchmarks.accuracy.two_ranks import run_two_ranks  # noqa: E402
from benchmarks.processes import MALLOC, rerun_with_stable_malloc  # noqa: E402
from profiler.batch_sizes import doubling_batch_sizes  # noqa: E402
from profiler.calibrate import store_calibration  # noqa: E402
from profiler.in_context import measure_compute_scale  # noqa: E402
from profiler.measure import profile_model  # noqa: E402
from profiler.profile import Profile  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
EXAMPLES = ("mlp", "convnet", "gpt2")
DEFAULT_EXAMPLES = ("mlp", "convnet")
# Examples the two-rank part runs (the GPT-2 example's traced units: one device only).
TWO_RANK_EXAMPLES = ("mlp", "convnet")
CHUNKS = 4  # the profile's M; the search varies it


def profile_and_calibrate(name: str, repeats: int, device: str) -> tuple[Any, Any, Profile]:
    model, sample = load_sequential(ROOT / "examples" / f"{name}.py")
    first = sample if isinstance(sample, torch.Tensor) else sample[0]
    sizes = doubling_batch_sizes(first.shape[0])
    print(f"[{name}] profiling {len(model)} layers on {device} at batch sizes {sizes}", flush=True)
    profile = profile_model(
        model, sample, device=device, chunks=CHUNKS, batch_sizes=sizes, repeats=repeats
    )
    overhead = measure_overhead([device, device], repeats=repeats)["overhead_s"]
    scales = measure_compute_scale(model, sample, profile, repeats=repeats)
    fixed, per_sample = scales["fixed_scale"], scales["compute_scale"]
    store_calibration(profile, overhead_s=overhead, compute_scale=per_sample, fixed_scale=fixed)
    print(
        f"[{name}] overhead {overhead * 1e6:.0f} µs per micro-batch; layers in a whole step: "
        f"{fixed:.2f}x per micro-batch, {per_sample:.2f}x per sample",
        flush=True,
    )
    return model, sample, profile


def _loss(output: Any) -> torch.Tensor:
    """The mean of the (first) output: a step's backward starts from it."""
    first = output if isinstance(output, torch.Tensor) else output[0]
    return first.float().mean()


def run_executor(model: Any, x: Any, plans: list[Plan], repeats: int, device: str) -> list[dict]:
    """Every plan on the GPipe executor on ``device``: medians of interleaved steps."""
    dev = torch.device(device)
    x = x.to(dev) if isinstance(x, torch.Tensor) else tuple(t.to(dev) for t in x)
    runs = []
    for plan in plans:
        pipe = GPipe(
            copy.deepcopy(model),
            plan.balance,
            devices=[dev] * plan.num_stages,
            chunks=plan.chunks,
            checkpoint=plan.stages[0].checkpoint,
        )
        runs.append((plan, pipe, torch.optim.Adam(pipe.parameters())))

    def stepper(pipe: GPipe, optimizer: torch.optim.Optimizer) -> Any:
        def step() -> float:
            optimizer.zero_grad(set_to_none=True)
            return timed(lambda: _loss(pipe(x)).backward(), dev)

        return step

    steps = {str(i): stepper(pipe, opt) for i, (_, pipe, opt) in enumerate(runs)}
    medians = interleaved_medians(steps, repeats, warmup=3)
    rows = []
    for i, (plan, pipe, optimizer) in enumerate(runs):
        step = lambda p=pipe: _loss(p(x)).backward()  # noqa: E731
        memory = stage_memory([pipe], optimizer, step, dev)
        rows.append(compare(plan, medians[str(i)], [memory]))
        pipe.close()
    return rows


def main() -> None:
    rerun_with_stable_malloc("benchmarks.accuracy.ranked_plans")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--top", type=int, default=6, help="ranked configurations to run")
    parser.add_argument("--examples", nargs="+", default=list(DEFAULT_EXAMPLES), choices=EXAMPLES)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to save the results")
    parser.add_argument("--stem", default=None, help="file name of the results (no suffix)")
    parser.add_argument("--no-distributed", action="store_true")
    parser.add_argument(
        "--no-bind", action="store_true", help="let the two ranks float over all CPUs"
    )
    parser.add_argument(
        "--device", default="cpu", help="cuda:0 for the GPU (the two-rank part then is skipped)"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="independent runs; the report gives medians"
    )
    args = parser.parse_args()
    distributed = not args.no_distributed and args.device == "cpu"
    torch.set_num_threads(1)
    runs = []
    for run in range(args.runs):
        print(f"run {run + 1} of {args.runs}", flush=True)
        runs.append(one_run(args, distributed))
    results = combine(runs)
    meta = {
        "device": runs and next(iter(runs[0].values()))["device_name"],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "threads": 1,
        "repeats": args.repeats,
        "runs": args.runs,
        "load": os.getloadavg(),
        "malloc": MALLOC,
        "bound_cpus": not args.no_bind,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("accuracy" if args.device == "cpu" else "accuracy_cuda")
    data = {"meta": meta, "results": results, "runs": runs if args.runs > 1 else []}
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    text = write_report(meta, results)
    (args.out / f"{stem}.md").write_text(text)
    print(text)


def one_run(args: argparse.Namespace, distributed: bool) -> dict[str, Any]:
    """Profiles, calibrates, searches and measures every example once."""
    results: dict[str, Any] = {}
    for name in args.examples:
        model, sample, profile = profile_and_calibrate(name, args.repeats, args.device)
        # The GPipe executor runs GPipe's schedule (1F1B plans would hold other memory).
        found = search(profile, devices=1, schedules=("gpipe",), top=4 * args.top)
        plans = distinct(found)[: args.top]
        print(f"[{name}] one device: running {len(plans)} ranked configurations", flush=True)
        single = run_executor(model, sample, plans, args.repeats, args.device)
        results[name] = {
            "calibration": profile.meta["calibration"],
            "device_name": profile.device_name,
            "one_device": single,
        }
        if distributed and name in TWO_RANK_EXAMPLES:
            print(f"[{name}] two devices: spawning 2 ranks", flush=True)
            results[name]["two_devices"] = run_two_ranks(
                name, profile, args.top, args.repeats, bind=not args.no_bind
            )
    return results


if __name__ == "__main__":
    main()
