"""Tests of the Profile data model and its JSON file."""

from __future__ import annotations

import dataclasses
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


def test_rebuilt_bytes_round_trip_and_are_written_only_when_set(tmp_path: Path) -> None:
    profile = make_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    assert all("rebuilt" not in layer for layer in json.loads(path.read_text())["layers"])
    layers = [dataclasses.replace(layer, rebuilt=[32, 64]) for layer in profile.layers]
    rebuilt = dataclasses.replace(profile, layers=layers)
    rebuilt.save(path)
    assert Profile.load(path) == rebuilt
    with pytest.raises(ValueError, match="rebuilt"):
        dataclasses.replace(profile, layers=[dataclasses.replace(layers[0], rebuilt=[-1, 0])])


@pytest.mark.parametrize("autocast", [None, "bfloat16", "float16"])
def test_autocast_round_trips(tmp_path: Path, autocast: str | None) -> None:
    profile = make_profile()
    profile.autocast = autocast
    path = tmp_path / "profile.json"
    profile.save(path)
    assert json.loads(path.read_text())["autocast"] == autocast
    loaded = Profile.load(path)
    assert loaded.autocast == autocast and loaded == profile


def test_profiles_saved_before_autocast_load_without_it(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    make_profile().save(path)
    data = json.loads(path.read_text())
    del data["autocast"]
    path.write_text(json.dumps(data))
    assert Profile.load(path).autocast is None


def test_a_bad_autocast_is_rejected(tmp_path: Path) -> None:
    good = make_profile()
    with pytest.raises(ValueError, match="autocast must be bfloat16 or float16, got 'fp8'"):
        Profile(layers=good.layers, batch_sizes=[2, 4], input=[1, 2], batch_size=4, autocast="fp8")
    path = tmp_path / "profile.json"
    good.save(path)
    data = json.loads(path.read_text())
    data["autocast"] = "float32"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="got 'float32'"):
        Profile.load(path)


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


def _hockey_stick() -> Profile:
    """A layer whose time is flat for small batches, then linear: far from one line."""
    layer = LayerProfile(
        name="0",
        kind="Linear",
        forward=[1.0, 1.0, 1.0, 2.0, 4.0],
        backward=[2.0, 2.0, 2.0, 4.0, 8.0],
        saved=[10, 20, 40, 80, 160],
        output=[4, 8, 16, 32, 64],
    )
    sizes = [1, 2, 4, 8, 16]
    return Profile(layers=[layer], batch_sizes=sizes, input=[2, 4, 8, 16, 32], batch_size=16)


def test_figures_are_interpolated_between_measured_sizes() -> None:
    profile = _hockey_stick()
    for size, value in zip(profile.batch_sizes, profile.layers[0].forward):
        assert profile.predict(0, "forward", size) == pytest.approx(value)
    assert profile.predict(0, "forward", 3) == pytest.approx(1.0)  # on the flat part
    assert profile.predict(0, "forward", 12) == pytest.approx(3.0)  # between 8 and 16
    assert profile.predict(0, "forward", 32) == pytest.approx(8.0)  # last segment goes on
    assert profile.segment(0, "forward", 12) == pytest.approx((0.0, 0.25))
    # A single line through all five misses some measurement by more than 25%.
    a, b = profile.fit(0, "forward")
    assert max(abs(a + b * s - v) / v for s, v in zip([1, 2, 4, 8, 16], [1, 1, 1, 2, 4])) > 0.25


def test_extrapolation_never_falls_with_the_batch() -> None:
    layer = LayerProfile("0", "Linear", [2.0, 1.0], [2.0, 3.0], [0, 0], [0, 0])
    profile = Profile(layers=[layer], batch_sizes=[2, 4], input=[0, 0], batch_size=4)
    assert profile.predict(0, "forward", 3) == pytest.approx(1.5)  # measured noise: kept
    assert profile.predict(0, "forward", 8) == pytest.approx(1.0)  # not below the last
    assert profile.predict(0, "forward", 1) == pytest.approx(2.0)
    # Below the smallest size a steep segment would cross zero: proportional instead.
    assert profile.predict(0, "backward", 1) == pytest.approx(1.5)  # 2.0 at 2, 3.0 at 4
    steep = LayerProfile("0", "Linear", [1.0, 3.0], [1.0, 3.0], [0, 0], [0, 0])
    low = Profile(layers=[steep], batch_sizes=[2, 4], input=[0, 0], batch_size=4)
    assert low.segment(0, "forward", 1) == pytest.approx((0.0, 0.5))
    single = Profile(layers=[layer.__class__("0", "L", [3.0], [6.0], [0], [0])],
                     batch_sizes=[4], input=[0], batch_size=4)  # fmt: skip
    assert single.segment(0, "forward", 2) == single.fit(0, "forward") == (0.0, 0.75)


def test_planner_predicts_measured_sizes_exactly() -> None:
    from autopipe.planning.model.layer_costs import ProfileLines

    profile = _hockey_stick()
    lines = ProfileLines.from_profile(profile)
    for size, f, b, saved in zip(
        [1, 2, 4, 8, 16], [1, 1, 1, 2, 4], [2, 2, 2, 4, 8], [10, 20, 40, 80, 160]
    ):
        costs = lines.at(size)
        assert costs.forward[0] == pytest.approx(f) and costs.backward[0] == pytest.approx(b)
        assert costs.saved[0] == pytest.approx(saved) and costs.input == pytest.approx(2 * size)
    # Calibration scales each segment's a (fixed_scale) and b·size (compute_scale) apart.
    profile.meta["calibration"] = {"fixed_scale": 2.0, "compute_scale": 3.0}
    scaled = ProfileLines.from_profile(profile).at(12)
    assert scaled.forward[0] == pytest.approx(2.0 * 0.0 + 3.0 * 0.25 * 12)


def _edited(tmp_path: Path, edit) -> Path:
    path = tmp_path / "model.profile.json"
    make_profile().save(path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["layers"][2]["forward"].__setitem__(1, -0.5),
            "layers[2].forward[1] is -0.5; times must be finite numbers of seconds >= 0",
        ),
        (lambda d: d["layers"][0]["backward"].__setitem__(0, float("nan")), "backward[0] is nan"),
        (lambda d: d["layers"][1]["saved"].__setitem__(0, "400"), "saved[0] is '400'; byte"),
        (lambda d: d["layers"][1].__setitem__("param_bytes", -1), "layers[1].param_bytes is -1"),
        (lambda d: d["layers"][0].__setitem__("name", 0), "layers[0].name must be a string"),
        (lambda d: d["layers"][0].__setitem__("forward", "1.0"), "layers[0].forward must be a"),
        (lambda d: d["layers"][0].__setitem__("shared", [1]), "layers[0].shared must be a list"),
        (lambda d: d["layers"][0].__setitem__("backward_input", [0]), "backward_input must be"),
        (lambda d: d.__setitem__("batch_sizes", [0, -1]), "batch_sizes[0] is 0; each batch"),
        (lambda d: d.__setitem__("batch_sizes", [4, 2]), "must be distinct and ascending"),
        (lambda d: d.__setitem__("batch_size", 0), "batch_size is 0; the batch size must be"),
        (lambda d: d.__setitem__("chunks", "2"), "chunks is '2'; the micro-batch count"),
        (lambda d: d.__setitem__("input", [-1, 2]), "input[0] is -1; byte counts"),
        (lambda d: d.__setitem__("meta", []), "meta must be an object"),
        (lambda d: d["layers"][0].__setitem__("forward", [1.0, float("nan")]), "forward[1] is nan"),
        (
            # Finite figures whose sum overflows: planning would add them up to inf.
            lambda d: [layer.__setitem__("backward", [1e308, 1e308]) for layer in d["layers"]],
            "layers[*].backward sums to inf over the layers, beyond the 1e+200",
        ),
        (lambda d: d["layers"][1].pop("forward"), "layers[1] lacks field 'forward'"),
        (lambda d: d["layers"][1].__setitem__("speed", 1), "layers[1] has unknown field 'speed'"),
        (lambda d: d.pop("batch_sizes"), "the profile lacks field 'batch_sizes'"),
        (lambda d: d.__setitem__("layers", {}), "layers must be a list"),
        (lambda d: d["layers"].__setitem__(0, 3), "layers\\[0\\] must be an object, got 3"),
    ],
)
def test_load_names_the_file_and_the_bad_field(tmp_path: Path, edit, message: str) -> None:
    path = _edited(tmp_path, edit)
    with pytest.raises(ValueError) as caught:
        Profile.load(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert message.replace("\\", "") in text


def test_profiles_built_in_code_are_checked() -> None:
    good = make_profile()
    layer = good.layers[0]
    with pytest.raises(ValueError, match="layers\\[0\\].forward\\[0\\] is -0.5"):
        Profile(
            layers=[LayerProfile("a", "Linear", [-0.5, 1], [1, 1], [1, 1], [1, 1])],
            batch_sizes=[2, 4],
            input=[1, 2],
            batch_size=8,
        )
    with pytest.raises(ValueError, match="batch_sizes\\[1\\] is -1"):
        Profile(layers=[layer], batch_sizes=[1, -1], input=[1, 2], batch_size=8)
    with pytest.raises(ValueError, match="batch_size is 0"):
        Profile(layers=[layer], batch_sizes=[2, 4], input=[1, 2], batch_size=0)
    with pytest.raises(ValueError, match="batch_size is 2.5"):
        Profile(layers=[layer], batch_sizes=[2, 4], input=[1, 2], batch_size=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layers\\[0\\] must be a LayerProfile"):
        Profile(layers=[{"name": "a"}], batch_sizes=[2, 4], input=[1, 2], batch_size=8)  # type: ignore[list-item]
