"""The bench suite's table: each strategy's measured step relative to optimal's, one row a run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IDEAL_MARGIN", "render", "row_of", "slower"]

# Optimal more than this far above the ideal bound gets the unit that bounds it named.
IDEAL_MARGIN = 0.10


def slower(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether split ``a`` measured slower than ``b`` beyond the measured spread: its median
    above ``b``'s by more than the larger of the two interquartile ranges (over the median);
    a smaller gap is a tie."""
    return bool(a["measured"] > b["measured"] * (1.0 + max(a["spread"], b["spread"])))


def row_of(record: dict[str, Any], strategies: Sequence[str]) -> dict[str, Any]:
    """The row of one ``autopipe bench --json`` record.

    Args:
        record: the record (its ``settings`` and ``splits``).
        strategies: the labels to compare, optimal first.
    """
    splits = {split["label"]: split for split in record["splits"]}
    best = splits[strategies[0]]
    others = [splits[name] for name in strategies[1:] if name in splits]
    bound = None
    if best["measured_over_ideal"] > 1.0 + IDEAL_MARGIN:
        unit = best["bound_unit"]
        bound = unit["name"] if unit else None
    return {
        "stages": record["settings"]["stages"],
        "chunks": record["settings"]["chunks"],
        "runner": record["settings"]["runner"],
        "strategies": {
            split["label"]: {
                "balance": split["balance"],
                "measured": split["measured"],
                "spread": split["spread"],
                "relative": split["measured"] / best["measured"],
                "predicted": split["predicted"],
            }
            for split in [best, *others]
        },
        "optimal_over_ideal": best["measured_over_ideal"],
        "optimal_predicted_over_ideal": best["predicted"] / best["ideal"],
        "optimal_over_predicted": best["measured_over_predicted"],
        "over_predicted": [split["measured_over_predicted"] for split in [best, *others]],
        "profiled": record["settings"].get("profiled", ""),
        "calibrated": record["settings"].get("calibrated", ""),
        "shared": bool(record["settings"].get("shared")),
        "optimal_slower_than": [split["label"] for split in others if slower(best, split)],
        "optimal_no_slower": not any(slower(best, split) for split in others),
        "above_ideal": best["measured_over_ideal"] > 1.0 + IDEAL_MARGIN,
        "bound_unit": bound,
    }


def _cell(entry: dict[str, Any], first: bool) -> str:
    balance = ",".join(str(n) for n in entry["balance"])
    spread = f"±{entry['spread'] * 100:.0f}%"
    if first:
        return f"{entry['measured'] * 1e3:.1f} ms {spread} [{balance}]"
    return f"{entry['relative']:.2f}x {spread} [{balance}]"


def _bound(row: dict[str, Any]) -> str:
    if not row["above_ideal"]:
        return "-"
    if row["bound_unit"]:
        return f"`{row['bound_unit']}`"
    # No unit outweighs a perfect share: the gap is the measured step over the predicted.
    return f"no unit (meas/pred {row['optimal_over_predicted']:.2f}x)"


def _range(row: dict[str, Any]) -> str:
    ratios = row.get("over_predicted") or [row["optimal_over_predicted"]]
    return f"{min(ratios):.2f}–{max(ratios):.2f}"


def render(record: dict[str, Any], strategies: Sequence[str]) -> str:
    """The Markdown table of the suite's ``record`` (its ``machine``, ``settings``, ``rows``)."""
    machine, settings = record["machine"], record["settings"]
    lines = [
        "# `autopipe bench` over models with unbalanced costs",
        "",
        f"Machine: {machine['processor']}, {machine['cpus']} CPUs, {machine['platform']}; "
        f"load average {machine['load_average'][0]} before, "
        f"{machine['load_average_after'][0]} after. {settings['steps']} timed steps per "
        f"split after {settings['warmup']} warm-up, the splits taking turns; SGD, loss the "
        f"mean of the output. Whole run {record['seconds'] / 60:.1f} min.",
        "",
        f"Cells: {strategies[0]}'s median step, the others' median relative to it; ± the "
        "interquartile range over the median; [units per stage]. *no slower*: optimal's "
        "median is within the larger spread of every other's, or below it. *bound*: where "
        "optimal is more than 10% above the ideal, the unit heavier than a perfect share "
        "Σc/K (none: the gap is measured over predicted).",
        "",
        "*meas/pred*: optimal's measured step over its predicted one, and the range over "
        "every strategy's split. Each split is predicted from the later half of its own "
        "warm-up steps, timed in place among the timed ones: on ranks every stage's forward "
        "and backward on its rank (one step in three recorded), the optimizer's step per "
        "parameter byte and the runner's cost per step (the median over the unrecorded "
        "steps), from a profile made bound to a rank's CPUs; in one process, where the stages "
        "take turns on the CPU (predicted so, M·Σc), one factor for every layer.",
        "",
        "| model | setting | M | "
        + " | ".join(strategies)
        + " | opt meas/pred | meas/pred, all | opt meas/ideal | opt pred/ideal | no slower "
        "| bound |",
        "|" + "---|" * (len(strategies) + 9),
    ]
    for row in record["rows"]:
        head = f"| {row['model']} | {row['setting']} |"
        if "error" in row:
            lines.append(f"{head} | failed: {row['error']} |")
            continue
        cells = [
            _cell(row["strategies"][name], i == 0) if name in row["strategies"] else "-"
            for i, name in enumerate(strategies)
        ]
        verdict = (
            "yes"
            if row["optimal_no_slower"]
            else ("no (" + ", ".join(row["optimal_slower_than"]) + ")")
        )
        lines.append(
            f"{head} {row['chunks']} | "
            + " | ".join(cells)
            + f" | {row['optimal_over_predicted']:.2f} | {_range(row)}"
            + f" | {row['optimal_over_ideal']:.2f}x | {row['optimal_predicted_over_ideal']:.2f}x"
            f" | {verdict} | {_bound(row)} |"
        )
    done = [row for row in record["rows"] if "error" not in row]
    if done:
        ratios = [row["optimal_over_predicted"] for row in done]
        within = sum(abs(ratio - 1.0) <= 0.05 for ratio in ratios)
        no_slower = sum(bool(row["optimal_no_slower"]) for row in done)
        lines += [
            "",
            f"Optimal's measured over predicted: {min(ratios):.2f}–{max(ratios):.2f}, "
            f"{within} of {len(done)} rows within ±5%; optimal no slower in {no_slower} "
            f"of {len(done)}.",
        ]
    return "\n".join(lines) + "\n"
