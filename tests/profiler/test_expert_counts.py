"""A layer's expert-parallel counts: validation and JSON round trip."""

from __future__ import annotations

import pytest

from profiler import ExpertCounts, LayerProfile, Profile


def _counts(**changes: object) -> ExpertCounts:
    figures: dict[str, object] = {
        "experts": 8,
        "top_k": 2,
        "blocks": 1,
        "param_bytes": 4096,
        "flops": [64.0, 128.0],
        "backward_flops": [128.0, 256.0],
        "backward_input_flops": [64.0, 128.0],
        "saved": [16, 32],
        "dispatch_bytes": [8, 16],
        "skew": 1.5,
        "groups": 4,
        "top_groups": 2,
    }
    figures.update(changes)
    return ExpertCounts(**figures)  # type: ignore[arg-type]


def _profile(experts: ExpertCounts | None) -> Profile:
    layer = LayerProfile(
        name="0", kind="Block", forward=[1.0, 2.0], backward=[2.0, 4.0], saved=[32, 64],
        output=[4, 8], param_bytes=8192, experts=experts,
    )  # fmt: skip
    return Profile(layers=[layer], batch_sizes=[1, 2], input=[4, 8], batch_size=2)


def test_the_counts_round_trip_through_the_profile_json() -> None:
    again = Profile.from_dict(_profile(_counts()).to_dict())
    assert again.layers[0].experts == _counts()


def test_a_layer_without_experts_reads_as_before() -> None:
    data = _profile(None).to_dict()
    assert "experts" not in data["layers"][0]
    assert Profile.from_dict(data).layers[0].experts is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"flops": [1.0]}, r"flops must be a list of one figure per batch size \(2\)"),
        ({"dispatch_bytes": [1, -1]}, r"dispatch_bytes\[1\] is -1"),
        ({"top_k": 9}, r"top_k is 9; it must lie in 1..experts \(8\)"),
        ({"experts": 2.5}, "experts is 2.5; it must be an integer"),
        ({"skew": 0.5}, "skew is 0.5"),
        ({"top_groups": 5}, "top_groups 5 of groups 4 must lie in 1..groups"),
        ({"groups": 3, "top_groups": 1}, r"the groups must divide the experts \(8\)"),
        ({"gate": 1}, "unknown field 'gate'"),
    ],
)
def test_bad_counts_are_refused_naming_the_field(changes: dict[str, object], message: str) -> None:
    data = _profile(_counts()).to_dict()
    data["layers"][0]["experts"].update(changes)
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(data)


def test_counts_written_before_group_limits_read_as_unlimited() -> None:
    data = _profile(_counts()).to_dict()
    for name in ("groups", "top_groups"):
        del data["layers"][0]["experts"][name]
    experts = Profile.from_dict(data).layers[0].experts
    assert experts is not None and (experts.groups, experts.top_groups) == (1, 1)


def test_a_missing_field_is_refused() -> None:
    data = _profile(_counts()).to_dict()
    del data["layers"][0]["experts"]["flops"]
    with pytest.raises(ValueError, match="experts is not valid"):
        Profile.from_dict(data)
