"""Tests of the Profile data model and its JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiler import PROFILE_VERSION, LayerProfile, Profile


def make_profile(peak: bool = False) -> Profile:
    layers = [
        LayerProfile(
            name=str(i),
            kind="Linear",
            forward=[1e-3 * (i + 1), 2e-3 * (i + 1)],
            backward=[2e-3 * (i + 1), 4e-3 * (i + 1)],
            saved=[400, 800],
            output=[100 * (i + 1), 200 * (i + 1)],
            param_bytes=1000,
            buffer_bytes=24 * i,
            peak=[50, 90] if peak else None,
        )
        for i in range(3)
    ]
    return Profile(
        layers=layers,
        batch_sizes=[2, 4],
        input=[64, 128],
        batch_size=8,
        chunks=2,
        device="cuda:0" if peak else "cpu",
        device_name="test",
        torch_version="2.x",
    )


def test_basic_queries() -> None:
    profile = make_profile()
    assert len(profile) == 3
    assert profile.names == ["0", "1", "2"]
    assert profile.micro_batch() == 4
    assert profile.micro_batch(3) == 3
    assert profile.layers[2].state_bytes == 1048
    assert profile.predict(0, "forward", 8) == pytest.approx(4e-3, rel=1e-6)
    assert profile.predict(-1, "input", 3) == pytest.approx(96, rel=1e-6)
    assert profile.fit(0, "peak") == (0.0, 0.0)
    assert set(profile.fits(1)) == {"forward", "backward", "saved", "output"}


@pytest.mark.parametrize("peak", [False, True])
def test_json_round_trip(tmp_path: Path, peak: bool) -> None:
    profile = make_profile(peak)
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    assert loaded.fits(2) == profile.fits(2)
    assert not list(tmp_path.glob("*.tmp"))


def test_wrong_version_raises(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    make_profile().save(path)
    data = json.loads(path.read_text())
    data["version"] = PROFILE_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        Profile.load(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"kind": "plan", "version": 1}', "not an autopipe profile"),
        ("[1, 2]", "not an autopipe profile"),
        ("not json", "not valid JSON"),
        (f'{{"kind": "profile", "version": {PROFILE_VERSION}}}', "not a valid autopipe profile"),
    ],
)
def test_not_a_profile_raises(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "other.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Profile.load(path)


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        Profile.load(tmp_path / "absent.json")


def test_inconsistent_profiles_are_rejected() -> None:
    good = make_profile()
    with pytest.raises(ValueError, match="at least one layer"):
        Profile(layers=[], batch_sizes=[1], input=[1], batch_size=1)
    with pytest.raises(ValueError, match="distinct"):
        Profile(layers=good.layers, batch_sizes=[2, 2], input=[1, 1], batch_size=4)
    with pytest.raises(ValueError, match="input"):
        Profile(layers=good.layers, batch_sizes=[2, 4], input=[1], batch_size=4)
    with pytest.raises(ValueError, match="one figure per batch size"):
        Profile(layers=good.layers, batch_sizes=[1, 2, 4], input=[1, 2, 3], batch_size=4)
