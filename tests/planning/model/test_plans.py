"""Plans round-trip through versioned JSON."""

from __future__ import annotations

import json

import pytest

from autopipe import Plan, plan
from tests.support.planning_cases import linear_profile


def test_json_round_trip(tmp_path):
    original = plan(linear_profile([1.0, 2.0, 3.0, 4.0], params=[10] * 4), 2, memory="1MiB")
    path = tmp_path / "plan.json"
    original.save(path)
    data = json.loads(path.read_text())
    assert data["kind"] == "plan" and data["balance"] == original.balance
    assert data["profile"]["layers"][0]["name"] == "l0"
    assert Plan.load(path) == original


def test_load_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(bad)
    bad.write_text(json.dumps({"kind": "profile"}))
    with pytest.raises(ValueError, match="not an autopipe plan"):
        Plan.load(bad)
    bad.write_text(json.dumps({"kind": "plan", "version": 99}))
    with pytest.raises(ValueError, match="version 99 is not supported"):
        Plan.load(bad)
    with pytest.raises(ValueError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")


def _edited_plan(tmp_path, edit):
    path = tmp_path / "plan.json"
    plan(linear_profile([1.0, 2.0, 3.0, 4.0], params=[10] * 4), 2, memory="1MiB").save(path)
    data = json.loads(path.read_text())
    assert data["balance"] == [3, 1]
    edit(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d.__setitem__("balance", [1, 3]),
            "stages[0] (index 0, start 0, stop 3, 3 layer names) contradicts balance [1, 3]",
        ),
        (lambda d: d.__setitem__("balance", [3, 3]), "stages[1] (index 1, start 3, stop 4"),
        (lambda d: d.__setitem__("balance", [1, 1, 2]), "balance [1, 1, 2] has 3 stages but"),
        (lambda d: d.__setitem__("balance", ["3", 1]), "balance[0] is '3'; it must be an integer"),
        (lambda d: d.__setitem__("balance", []), "balance is []; it must be a non-empty list"),
        (lambda d: d["stages"][1].__setitem__("index", 0), "stages[1] (index 0, start 3"),
        (lambda d: d["stages"][0]["layers"].pop(), "stages[0] (index 0, start 0, stop 3, 2 layer"),
        (lambda d: d.__setitem__("chunks", 0), "chunks is 0; it must be an integer >= 1"),
        (lambda d: d["devices"].pop(), "devices lists 1 devices for 2 stages"),
        (lambda d: d.__setitem__("schedule", "zigzag"), "schedule is 'zigzag'; choose gpipe"),
        (lambda d: d["stages"][0].__setitem__("checkpoint", "often"), "stages[0].checkpoint is"),
        (lambda d: d["profile"]["layers"].pop(), "splits 4 layers but the plan's profile has 3"),
        (lambda d: d["devices"][0].__setitem__("memory", "lots"), "cannot parse memory size"),
        (lambda d: d.__setitem__("step_time", float("nan")), "step_time is nan; it must be"),
        (lambda d: d.__setitem__("bubble", "0.1"), "bubble is '0.1'; it must be a finite"),
        (
            lambda d: d["stages"][1].__setitem__("memory", float("inf")),
            "stages[1].memory is inf; it must be a finite number >= 0",
        ),
        (
            lambda d: d["profile"]["layers"][1]["forward"].__setitem__(0, -1.0),
            "profile: layers[1].forward[0] is -1.0; times must be finite",
        ),
    ],
)
def test_load_refuses_a_plan_that_contradicts_itself(tmp_path, edit, message):
    path = _edited_plan(tmp_path, edit)
    with pytest.raises(ValueError) as caught:
        Plan.load(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert message in text


def test_a_mesh_plan_round_trips_through_json(tmp_path) -> None:
    from autopipe.planning import SearchOptions, search
    from autopipe.planning.mesh.mesh_links import GroupLink, MeshLinks
    from tests.support.mesh_profiles import block_profile, roofline_record

    profile = block_profile(4, batch=8, estimate=roofline_record())
    options = SearchOptions(
        tensor_parallel=(2,), context_parallel=(2,), sequence_parallel=(True,), zero=(3,),
        micro_batch=1, links=MeshLinks.uniform(GroupLink(64.0, 0.5)), sequence=16, top=1,
    )  # fmt: skip
    best = search(profile, 8, optimizer="adam", options=options)[0]
    assert best.mesh.tensor == 2 and best.mesh.context == 2 and best.mesh.zero == 3
    path = tmp_path / "plan.json"
    best.save(path)
    again = Plan.load(path)
    assert again.mesh == best.mesh and again.num_devices == 8
    assert (again.model_flops, again.peak_flops, again.sequence) == (
        best.model_flops, best.peak_flops, 16,
    )  # fmt: skip
    assert again.mesh_parts == best.mesh_parts and again.to_dict() == best.to_dict()
