"""Mixtures of experts planned as practitioners train them: DeepSeek-V3 and Mixtral-8x7B.

Each case plans a bundled meta model (``examples/deepseek_v3.py``,
``examples/mixtral_8x7b.py``) with ``autopipe plan --target ... --search``, the routing
assumed balanced, the default efficiencies (nothing fitted):

- **DeepSeek-V3 on 2,048 H800s** at the end of its batch schedule (15,360 sequences of
  4,096 tokens, one per micro-batch), FP8 pricing (``--peak-dtype float8``: the report
  trains its GEMMs in FP8), Adam in mixed precision: (a) the published mesh (TP1, PP16
  under DualPipeV, EP64, ZeRO-1 data parallelism over the other 128 ranks) predicted in
  tokens/s per GPU against the report's 14.8T tokens in 2,664K H800 GPU-hours, 1,543
  tokens/s per GPU (a figure derived from the whole pre-training, not measured at one
  step); every plan re-computes the norms and the latent attention's up-projections
  (``--recompute-norms --recompute-up-proj``), as the report says DeepSeek-V3 trains;
  (b) the search's best mesh over TP 1-8, every EP, ZeRO 0-1 and the 1F1B, GPipe and
  interleaved schedules; (c) the published mesh's rank among the meshes the search
  ranks, found with a second search held to DualPipeV, TP1 and EP64 (where it does not
  fit as counted, its rank by predicted step among the meshes of a search without the
  memory cap, also given); and the seconds
  and peak memory of the search as ``autopipe plan --search`` runs it (its default ten
  plans, the profile counted afresh), beside those of the search that returns the
  ``TOP`` plans the rank needs (which prunes far less).
- **Mixtral-8x7B on 8 and 64 H100s** (256 sequences of 4,096 tokens, one per
  micro-batch, bfloat16): the best plan with EP8 × TP1 against the best with EP4 × TP2
  (Megatron-LM's MoE guide reports the first faster), and the search's best.

Both models are planned with the kernels these runs train with (``--eager``: Hugging
Face's modules unchanged): RMSNorm and SwiGLU fused, keeping their inputs only, and
attention causal without a mask (:mod:`benchmarks.planning.fused_llama`); the routed
experts run as counted (:mod:`profiler.expert_routing`).

Run: ``python -m benchmarks.planning.moe_practice [--cases deepseek-v3,mixtral-8,...]
[--eager]``; results go to ``benchmarks/results/moe_practice.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autopipe import PlanningError  # noqa: E402
from autopipe.cli.parser import build_parser  # noqa: E402
from autopipe.cli.search_command import search_inputs  # noqa: E402
from autopipe.planning import Plan, search  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# Plans the whole search returns: enough to rank the published mesh among them.
TOP = 400
# DeepSeek-V3's report: 14.8T pre-training tokens in 2,664K H800 GPU-hours.
DEEPSEEK_TOKENS_PER_GPU = 14.8e12 / (2.664e6 * 3600)
# (TP, CP, EP, PP, DP) of DeepSeek-V3's pre-training: pipeline 16 (DualPipe), experts over
# 64 devices, no tensor parallelism, the 128 replicas left.
PUBLISHED_MESH = (1, 1, 64, 16, 128)


@dataclass(frozen=True)
class Case:
    """One planned training job.

    Attributes:
        name: a short label.
        model: the model file under ``examples/``.
        target: the catalog device.
        gpus: devices of the job.
        global_batch: sequences per step.
        sequence: tokens per sequence.
        dtype: the peak the FLOPs are priced at.
        flags: the rest of ``autopipe plan``'s arguments.
        fused: a folder to write the model with fused kernels to (``None``: the example
            unchanged).
    """

    name: str
    model: str
    target: str
    gpus: int
    global_batch: int
    sequence: int
    dtype: str
    flags: tuple[str, ...] = ()
    fused: Path | None = None

    def path(self) -> Path:
        """The model file: the example, or its fused form in the folder ``fused``."""
        if self.fused is None:
            return ROOT / "examples" / self.model
        return fused_file(self.model, self.fused)

    def arguments(self, *extra: str) -> list[str]:
        """``autopipe plan --search`` as a user states the job."""
        return [
            "plan", str(self.path()), "--target", self.target,
            "--peak-dtype", self.dtype, "--search", "--devices", str(self.gpus),
            "--per-node", "8", "--global-batch", str(self.global_batch), "--micro-batch",
            "1", "--sequence", str(self.sequence), "--optimizer", "adam-mixed",
            "--top", str(TOP), *self.flags, *extra,
        ]  # fmt: skip


# The example's model with the training runs' fused kernels, as a model file.
FUSED_FILE = '''"""{example} with fused norms and SwiGLU and causal attention without a mask."""
import sys

sys.path[:0] = [{examples!r}, {root!r}]
from benchmarks.planning.fused_llama import fuse  # noqa: E402
from {module} import model as _model  # noqa: E402
from {module} import sample  # noqa: E402, F401


def model():
    return fuse(_model())
'''
DEEPSEEK = Case(
    "deepseek-v3", "deepseek_v3.py", "h800", 2048, 15360, 4096, "float8",
    ("--tensor-parallel", "1,2,4,8", "--zero", "0,1", "--expert-parallel", "auto",
     "--virtual-stages", "2", "--recompute-norms", "--recompute-up-proj"),
)  # fmt: skip
MIXTRAL = {
    gpus: Case(
        f"mixtral-{gpus}",
        "mixtral_8x7b.py",
        "h100",
        gpus,
        256,
        4096,
        "bfloat16",
        ("--zero", "0,1,2,3", "--sequence-parallel", "--virtual-stages", "2"),
    )
    for gpus in (8, 64)
}


def fused_file(example: str, folder: Path) -> Path:
    """The example ``example`` (a file under ``examples/``) with fused kernels, in ``folder``."""
    module = example.removesuffix(".py")
    path = folder / f"{module}_fused.py"
    if not path.exists():
        text = FUSED_FILE.format(
            example=example, examples=str(ROOT / "examples"), root=str(ROOT), module=module
        )
        path.write_text(text)
    return path


def mesh_of(plan: Plan) -> tuple[int, int, int, int, int, int]:
    """``(TP, CP, EP, PP, DP, VP)`` of a plan (a V schedule's 2K stages on K ranks)."""
    v = max(plan.virtual_stages, 1)
    return (
        plan.mesh.tensor,
        plan.mesh.context,
        plan.mesh.expert,
        plan.num_stages // v,
        plan.data_parallel,
        v,
    )


def label(plan: Plan) -> str:
    t, c, e, k, d, v = mesh_of(plan)
    zero = f" ZeRO-{plan.mesh.zero}" if plan.mesh.zero else ""
    sp = " SP" if plan.mesh.sequence_parallel else ""
    norms = "+norms" if plan.recompute_norms else ""
    norms += "+up-proj" if plan.recompute_up_proj else ""
    return f"TP{t}{sp} CP{c} EP{e} PP{k} VP{v} DP{d}{zero} {plan.schedule} {plan.checkpoint}{norms}"


def tokens_per_gpu(plan: Plan, case: Case) -> float:
    return case.global_batch * case.sequence / plan.step_time / case.gpus


def memory(plan: Plan) -> float:
    return max(plan.device_memory or [stage.memory for stage in plan.stages]) / 2**30


def _search(case: Case, *extra: str, capped: bool = True) -> tuple[list[Plan], float, float, float]:
    """The plans of one search, its seconds (counting included), this process's peak
    resident GiB after it and the devices' usable GiB; ``capped=False`` searches without
    that cap."""
    started = time.perf_counter()
    inputs = search_inputs(build_parser().parse_args(case.arguments(*extra)))
    settings = inputs.settings if capped else dataclasses.replace(inputs.settings, memory=None)
    plans = search(inputs.profile, inputs.devices, settings, inputs.options)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return plans, seconds, peak, float(inputs.settings.memory or 0) / 2**30


def _ranked(plans: list[Plan]) -> list[tuple[int, ...]]:
    """The meshes in the search's order, each at its best plan."""
    meshes: list[tuple[int, ...]] = []
    for plan in plans:
        if mesh_of(plan) not in meshes:
            meshes.append(mesh_of(plan))
    return meshes


def _row(plan: Plan, case: Case) -> dict[str, Any]:
    return {
        "mesh": label(plan),
        "step_s": plan.step_time,
        "tokens_per_gpu": tokens_per_gpu(plan, case),
        "memory_gib": memory(plan),
        "notes": plan.notes[:1],
    }


def deepseek(fused: Path | None) -> dict[str, Any]:
    """(a), (b) and (c) for DeepSeek-V3 (see the module docstring)."""
    case = dataclasses.replace(DEEPSEEK, fused=fused)
    # As a user runs it (the CLI's ten plans, which prune the most), counting included;
    # then the TOP plans that rank the published mesh, from the cached profile.
    quick, seconds, peak, _ = _search(case, "--top", "10", "--no-cache")
    plans, ranking_s, _, _ = _search(case)
    best = plans[0]
    assert mesh_of(quick[0]) == mesh_of(best), "the ten plans' best is the ranking's"
    as_published = (
        "--schedule", "dualpipev", "--expert-parallel", "64", "--zero", "1",
        "--tensor-parallel", "1", "--pipeline-parallel", "16",
    )  # fmt: skip
    try:
        published_plans, _, _, _ = _search(case, *as_published)
    except PlanningError as exc:  # names the closest and by how much it is over
        published_plans, refusal = [], str(exc)
    else:
        refusal = ""
    published = next((p for p in published_plans if mesh_of(p)[:5] == PUBLISHED_MESH), None)
    over = None
    if published is None:  # predicted without the memory cap, as far over as counted
        unlimited, _, _, capacity = _search(case, *as_published, capped=False)
        published = next((p for p in unlimited if mesh_of(p)[:5] == PUBLISHED_MESH), None)
        over = memory(published) - capacity if published is not None else None
    result: dict[str, Any] = {
        "case": case.name,
        "search_s": seconds,
        "ranking_search_s": ranking_s,
        "peak_gib": peak,
        "best": _row(best, case),
        "reported_tokens_per_gpu": DEEPSEEK_TOKENS_PER_GPU,
        "published": None,
        "rank": None,
        "meshes": len(_ranked(plans)),
        "refusal": refusal,
        "over_gib": over,
    }
    if published is not None:
        result["published"] = _row(published, case)
        result["ratio"] = tokens_per_gpu(published, case) / DEEPSEEK_TOKENS_PER_GPU
        # Its rank: among the first search's meshes by step, the published one placed
        # by its own step (DualPipeV is weighed in the second search only). Where it does
        # not fit as counted, among the meshes of a search without the memory cap too.
        ranked = plans
        if over is not None:
            ranked, _, _, _ = _search(case, capped=False)
            result["uncapped_best"] = _row(ranked[0], case)
        steps = [min(p.step_time for p in ranked if mesh_of(p) == m) for m in _ranked(ranked)]
        result["rank"] = 1 + sum(step < published.step_time for step in steps)
        result["ranked_meshes"] = len(steps)
    return result


def mixtral(gpus: int, fused: Path | None) -> dict[str, Any]:
    """The best plan at EP8 × TP1 and at EP4 × TP2, and the search's best."""
    case = dataclasses.replace(MIXTRAL[gpus], fused=fused)
    started = time.perf_counter()
    try:
        plans, seconds, peak, _ = _search(
            case, "--tensor-parallel", "1,2,4,8", "--expert-parallel", "auto"
        )
    except PlanningError as exc:  # says which mesh came closest and by how much
        seconds = time.perf_counter() - started
        return {"case": case.name, "search_s": seconds, "refused": str(exc)}
    rows: dict[str, Any] = {"case": case.name, "search_s": seconds, "peak_gib": peak}
    rows["best"] = _row(plans[0], case)
    for name, (t, e) in {"ep8_tp1": (1, 8), "ep4_tp2": (2, 4)}.items():
        found = next((p for p in plans if (p.mesh.tensor, p.mesh.expert) == (t, e)), None)
        rows[name] = _row(found, case) if found is not None else None
    return rows


def markdown(results: list[dict[str, Any]], *, fused: bool) -> str:
    kernels = (
        "fused norms and SwiGLU, causal attention without a mask"
        if fused
        else "Hugging Face's modules unchanged (`--eager`)"
    )
    lines = [
        "# Mixtures of experts planned as trained",
        "",
        f"`python -m benchmarks.planning.moe_practice` on {platform.node() or 'this host'} "
        f"({platform.processor() or platform.machine()}); models: {kernels}; routing "
        "assumed balanced; default efficiencies (nothing fitted).",
        "",
    ]
    for r in results:
        if r["case"] == "deepseek-v3":
            lines += [
                "## DeepSeek-V3, 2,048 H800s, 15,360 × 4,096 tokens, FP8",
                "",
                f"Search as `autopipe plan --search` runs it (its ten plans, counting "
                f"included): {r['search_s']:.0f} s, peak resident {r['peak_gib']:.2f} GiB; "
                f"the {TOP} plans that rank the published mesh (the profile cached): "
                f"{r['ranking_search_s']:.0f} s, {r['meshes']} meshes ranked.",
                "",
                "| plan | mesh | step | tokens/s per GPU | memory |",
                "|---|---|---:|---:|---:|",
            ]
            rows = [("search's best", r["best"])]
            if r["published"] is not None:
                rows.insert(0, ("published mesh", r["published"]))
            for name, row in rows:
                lines.append(
                    f"| {name} | {row['mesh']} | {row['step_s']:.2f} s "
                    f"| {row['tokens_per_gpu']:.0f} | {row['memory_gib']:.1f} GiB |"
                )
            lines.append("")
            reported = r["reported_tokens_per_gpu"]
            if r["published"] is None:
                lines.append(
                    "- The published mesh (PP16 DualPipeV, EP64, ZeRO-1) does not fit under "
                    f"the counted memory: {r['refusal'] or 'not among the plans found'}"
                )
            else:
                over = r.get("over_gib")
                if over is not None:
                    lines.append(
                        "- The published mesh (PP16 DualPipeV, EP64, ZeRO-1) does not fit "
                        f"under the counted memory, {over:.1f} GiB over each device: it is "
                        "predicted here without the cap, keeping every activation but the "
                        "norms' outputs and the up-projections' queries, keys and values, "
                        "so not ranked among the meshes that fit."
                    )
                rank = "" if over is not None else f"; rank {r['rank']} of {r['meshes'] + 1}"
                lines.append(
                    f"- Published mesh predicted at {r['published']['tokens_per_gpu']:.0f} "
                    f"tokens/s per GPU against the report's {reported:.0f} (derived: 14.8T "
                    f"tokens over 2,664K GPU-hours, FP8): {r['ratio']:.2f}{rank}."
                )
                if over is not None:
                    best = r["uncapped_best"]
                    lines.append(
                        f"- Its rank without the memory cap: {r['rank']} of "
                        f"{r['ranked_meshes'] + 1} by predicted step among the meshes the "
                        f"search weighs without the cap too (their best: {best['mesh']}, "
                        f"{best['tokens_per_gpu']:.0f} tokens/s per GPU, "
                        f"{best['memory_gib']:.0f} GiB per device)."
                    )
            for note in r["best"]["notes"]:
                lines.append(f"- The search's best: {note}.")
            lines.append("")
        elif "refused" in r:
            lines += [
                f"## {r['case']}: Mixtral-8x7B, 256 × 4,096 tokens, bfloat16",
                "",
                f"No mesh fits ({r['search_s']:.0f} s): {r['refused']}",
                "",
            ]
        else:
            lines += [
                f"## {r['case']}: Mixtral-8x7B, 256 × 4,096 tokens, bfloat16",
                "",
                f"Search: {r['search_s']:.0f} s, peak resident {r['peak_gib']:.2f} GiB.",
                "",
                "| plan | mesh | step | tokens/s per GPU | memory |",
                "|---|---|---:|---:|---:|",
            ]
            for name in ("best", "ep8_tp1", "ep4_tp2"):
                row = r[name]
                title = {"best": "search's best", "ep8_tp1": "EP8 × TP1",
                         "ep4_tp2": "EP4 × TP2"}[name]  # fmt: skip
                if row is None:
                    lines.append(f"| {title} | none fits | | | |")
                    continue
                lines.append(
                    f"| {title} | {row['mesh']} | {row['step_s']:.2f} s "
                    f"| {row['tokens_per_gpu']:.0f} | {row['memory_gib']:.1f} GiB |"
                )
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="deepseek-v3,mixtral-8,mixtral-64")
    parser.add_argument("--eager", action="store_true", help="plan HF's models unchanged")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        fused = None if args.eager else Path(folder)
        for name in args.cases.split(","):
            print(f"{name}: planning ...", file=sys.stderr, flush=True)
            if name == "deepseek-v3":
                results.append(deepseek(fused))
            else:
                results.append(mixtral(int(name.split("-")[1]), fused))
            print(json.dumps(results[-1], indent=1)[:2000], file=sys.stderr, flush=True)
    name = "moe_practice" + ("_eager" if args.eager else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(results, fused=not args.eager))
    print(markdown(results, fused=not args.eager))


if __name__ == "__main__":
    main()
