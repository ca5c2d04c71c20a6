"""Timeline and stage-bar pictures of a plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autopipe.output.timeline import (
    check_picture_path,
    draw_stage_bars,
    draw_timeline,
    require_matplotlib,
)
from autopipe.planning.planner import evaluate
from autopipe.planning.schedules.simulation import makespan, simulate
from tests.support.planning_cases import linear_profile
from tests.support.timeline_cases import (
    SCHEDULES,
    check_schedule,
    make_plan,
    virtual_plan,
)


def test_draw_timeline_png_and_svg(tmp_path: Path) -> None:
    plan = make_plan([1, 2, 3], checkpoint="except_last", bandwidth=10.0, output=[10] * 6)
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    draw_timeline(plan, png)
    draw_timeline(plan, str(svg))
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 5000
    assert b"<svg" in svg.read_bytes()[:2000]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png", "t.svg"]  # no temp files


def test_draw_timeline_many_micro_batches(tmp_path: Path) -> None:
    plan = make_plan([1] * 6, chunks=32, checkpoint="always", schedule="1f1b")
    draw_timeline(plan, tmp_path / "big.PNG")
    assert (tmp_path / "big.PNG").stat().st_size > 0


def test_draw_stage_bars(tmp_path: Path) -> None:
    plans = {
        "optimal": make_plan([3, 2, 1], checkpoint="always"),
        "uniform": make_plan([2, 2, 2], checkpoint="always"),
        "two stages": make_plan([3, 3], checkpoint="always"),
    }
    draw_stage_bars(plans, tmp_path / "bars.png")
    draw_stage_bars(plans, tmp_path / "bars.svg")
    assert (tmp_path / "bars.png").read_bytes().startswith(b"\x89PNG")
    assert b"<svg" in (tmp_path / "bars.svg").read_bytes()[:2000]
    with pytest.raises(ValueError, match="at least one plan"):
        draw_stage_bars({}, tmp_path / "none.png")


@pytest.mark.parametrize("name", ["t.pdf", "t", "t.png.txt", "t.jpg"])
def test_bad_extension(tmp_path: Path, name: str) -> None:
    plan = make_plan([3, 3])
    with pytest.raises(ValueError, match=r"use a \.png or \.svg"):
        draw_timeline(plan, tmp_path / name)
    with pytest.raises(ValueError, match=r"use a \.png or \.svg"):
        draw_stage_bars({"given": plan}, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_check_picture_path() -> None:
    assert check_picture_path("a/b.png") == "png"
    assert check_picture_path(Path("B.SVG")) == "svg"


def test_unwritable_directory(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot write the timeline"):
        draw_timeline(make_plan([3, 3]), tmp_path / "missing" / "t.png")


def test_missing_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError, match=r"autopipe\[plot\]"):
        require_matplotlib()
    with pytest.raises(ImportError, match="needs matplotlib"):
        draw_timeline(make_plan([3, 3]), tmp_path / "t.png")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_draw_timeline_with_virtual_stages(tmp_path: Path, schedule: str) -> None:
    plan = virtual_plan(2, 3, 4, schedule, "except_last", bandwidth=50.0, output=[20] * 12)
    picture = tmp_path / "virtual.svg"
    draw_timeline(plan, picture)
    text = picture.read_text()
    assert "device 1" in text and "stages 1, 3, 5" in text  # one row per device
    name = "interleaved 1f1b" if schedule == "1f1b" else "looped bfs"
    assert name in text


def test_draw_timeline_zero_bubble(tmp_path: Path) -> None:
    profile = linear_profile([1.0, 2.0, 3.0, 1.0, 1.0, 4.0, 2.0, 1.0], params=[100] * 8)
    plan = evaluate(profile, [2] * 4, chunks=4, schedule="zb", virtual_stages=2, checkpoint="never")
    events = simulate(plan)
    check_schedule(plan, [e for e in events if e.kind != "weight"])
    weights = [e for e in events if e.kind == "weight"]
    assert len(weights) == 2 * 2 * 4 and all(e.duration > 0 for e in weights)
    assert makespan(events) == pytest.approx(plan.step_time)
    picture = tmp_path / "zb.svg"
    draw_timeline(plan, picture)
    text = picture.read_text()
    assert "zero bubble, 2 stages per device" in text and "weight" in text
