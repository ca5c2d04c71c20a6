"""Output: what renders or reports a plan — the text report, timelines, trace events, bench tables.

Its own layer, not planning: it reads plans and simulations and writes text, pictures and
trace files, and planning needs none of it. It sits above :mod:`autopipe.planning` and
beside :mod:`autopipe.graph` (independent of it), below the runners, so that
``DistributedPipeline`` records trace events and both runners' benches fill
:class:`Measured` records. Every name below loads its module on first use; no torch, and
matplotlib only when a picture is drawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe.output.bench_report import draw_bench, render_bench
    from autopipe.output.bench_summary import (
        Measured,
        bench_record,
        ideal_step,
        merge_stage_seconds,
        summarize,
        unit_costs,
    )
    from autopipe.output.report import precision_label, render_plan, render_search, shared_line
    from autopipe.output.timeline import (
        check_picture_path,
        draw_stage_bars,
        draw_timeline,
        require_matplotlib,
    )
    from autopipe.output.trace_events import (
        Track,
        check_trace_path,
        stages_label,
        trace,
        trace_document,
        write_trace,
        write_trace_document,
    )

__all__ = [
    "Measured",
    "Track",
    "bench_record",
    "check_picture_path",
    "check_trace_path",
    "draw_bench",
    "draw_stage_bars",
    "draw_timeline",
    "ideal_step",
    "merge_stage_seconds",
    "precision_label",
    "render_bench",
    "render_plan",
    "render_search",
    "require_matplotlib",
    "shared_line",
    "stages_label",
    "summarize",
    "trace",
    "trace_document",
    "unit_costs",
    "write_trace",
    "write_trace_document",
]

_HOMES = {
    "Measured": "autopipe.output.bench_summary",
    "Track": "autopipe.output.trace_events",
    "bench_record": "autopipe.output.bench_summary",
    "check_picture_path": "autopipe.output.timeline",
    "check_trace_path": "autopipe.output.trace_events",
    "draw_bench": "autopipe.output.bench_report",
    "draw_stage_bars": "autopipe.output.timeline",
    "draw_timeline": "autopipe.output.timeline",
    "ideal_step": "autopipe.output.bench_summary",
    "merge_stage_seconds": "autopipe.output.bench_summary",
    "precision_label": "autopipe.output.report",
    "render_bench": "autopipe.output.bench_report",
    "render_plan": "autopipe.output.report",
    "render_search": "autopipe.output.report",
    "require_matplotlib": "autopipe.output.timeline",
    "shared_line": "autopipe.output.report",
    "stages_label": "autopipe.output.trace_events",
    "summarize": "autopipe.output.bench_summary",
    "trace": "autopipe.output.trace_events",
    "trace_document": "autopipe.output.trace_events",
    "unit_costs": "autopipe.output.bench_summary",
    "write_trace": "autopipe.output.trace_events",
    "write_trace_document": "autopipe.output.trace_events",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
