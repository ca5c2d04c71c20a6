"""Tests of profiler.tp_styles: the styles the counting knows and what each shards."""

from __future__ import annotations

import pytest

from profiler.tp_styles import COLUMN, EMBEDDING, ROW, SHARD_STYLES, check_styles, sharded_roles


def test_every_grouped_style_is_a_known_one() -> None:
    assert set(SHARD_STYLES) >= COLUMN | ROW | EMBEDDING


def test_a_rowwise_bias_is_added_whole_after_the_reduction() -> None:
    assert sharded_roles("rowwise", "weight")
    assert not sharded_roles("rowwise", "bias")
    assert sharded_roles("colwise", "bias")
    assert sharded_roles("embedding_rowwise", "weight")
    assert not sharded_roles("replicate", "weight")


def test_an_unknown_style_is_refused_by_name() -> None:
    check_styles({"mlp.up_proj": "colwise"}, "layer 3")
    with pytest.raises(ValueError, match=r"'diagonal' for mlp.up_proj of layer 3; use one of"):
        check_styles({"mlp.up_proj": "diagonal"}, "layer 3")
