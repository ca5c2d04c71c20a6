"""Plans round-trip through versioned JSON."""

from __future__ import annotations

import json

import pytest

from autopipe import Plan, plan
from tests.planning_cases import linear_profile


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
