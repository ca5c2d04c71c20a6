"""A layer's tensor- and context-parallel counts: validation and JSON round trip."""

from __future__ import annotations

import pytest

from profiler import LayerProfile, Profile, ShardCounts


def _counts(**changes: object) -> ShardCounts:
    figures: dict[str, object] = {
        "flops": [8.0, 16.0],
        "backward_flops": [16.0, 32.0],
        "backward_input_flops": [8.0, 16.0],
        "traffic": [4.0, 8.0],
        "backward_traffic": [8.0, 16.0],
        "saved": [2, 4],
        "param_bytes": 64,
        "reduce_forward": [4, 8],
        "reduce_backward": [4, 8],
        "reductions": 2,
        "replicated_saved": [1, 2],
        "attention_flops": [2.0, 4.0],
        "attention_backward_flops": [4.0, 8.0],
        "kv_bytes": [2, 4],
        "attention_calls": 1,
        "heads": 4,
        "kv_heads": 2,
    }
    figures.update(changes)
    return ShardCounts(**figures)  # type: ignore[arg-type]


def _profile(shards: ShardCounts | None) -> Profile:
    layer = LayerProfile(
        name="0", kind="Block", forward=[1.0, 2.0], backward=[2.0, 4.0], saved=[8, 16],
        output=[4, 8], param_bytes=128, shards=shards,
    )  # fmt: skip
    return Profile(layers=[layer], batch_sizes=[1, 2], input=[4, 8], batch_size=2)


def test_the_counts_round_trip_through_the_profile_json() -> None:
    profile = _profile(_counts())
    again = Profile.from_dict(profile.to_dict())
    assert again.layers[0].shards == _counts()


def test_a_layer_without_counts_reads_as_before() -> None:
    data = _profile(None).to_dict()
    assert "shards" not in data["layers"][0]
    assert Profile.from_dict(data).layers[0].shards is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"flops": [1.0]}, r"flops must be a list of one figure per batch size \(2\)"),
        ({"kv_bytes": [1, -1]}, r"kv_bytes\[1\] is -1"),
        ({"heads": float("nan")}, "heads is nan"),
    ],
)
def test_bad_counts_are_refused_naming_the_field(changes: dict[str, object], message: str) -> None:
    data = _profile(_counts()).to_dict()
    data["layers"][0]["shards"].update(changes)
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(data)


def test_an_unknown_or_missing_field_is_refused() -> None:
    data = _profile(_counts()).to_dict()
    data["layers"][0]["shards"]["experts"] = 1
    with pytest.raises(ValueError, match="unknown field 'experts'"):
        Profile.from_dict(data)
    data = _profile(_counts()).to_dict()
    del data["layers"][0]["shards"]["flops"]
    with pytest.raises(ValueError, match="shards is not valid"):
        Profile.from_dict(data)
