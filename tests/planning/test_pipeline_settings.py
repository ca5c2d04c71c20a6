"""``PipelineSettings``: defaults decided once, keywords checked, the same plan either way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopipe import plan
from autopipe.planning.configuration.config_search import SearchOptions, search
from autopipe.planning.pipeline_settings import (
    FIELDS,
    PipelineSettings,
    default_checkpoint,
    default_chunks,
    with_overrides,
)
from tests.support.planning_cases import linear_profile, random_profile


@pytest.mark.parametrize(
    ("schedule", "virtual", "mode"),
    [
        ("gpipe", 1, "except_last"),
        ("1f1b", 1, "except_last"),
        ("zb", 1, "never"),
        ("gpipe", 2, "never"),
        ("1f1b", 3, "never"),
        ("zb", 2, "never"),
    ],
)
def test_checkpoint_rule(schedule: str, virtual: int, mode: str) -> None:
    assert default_checkpoint(schedule, virtual) == mode
    resolved = PipelineSettings(schedule=schedule, virtual_stages=virtual).resolved(2, 16)
    assert resolved.checkpoint == mode


def test_resolved_fills_only_what_is_unset() -> None:
    resolved = PipelineSettings().resolved(3, 64)
    assert (resolved.chunks, resolved.schedule, resolved.checkpoint) == (
        default_chunks(3, 64),
        "gpipe",
        "except_last",
    )
    assert PipelineSettings().resolved(3, 64, distributed=True).schedule == "1f1b"
    assert PipelineSettings().resolved(3, 64, profile_chunks=5).chunks == 5
    assert PipelineSettings().resolved().chunks is None  # nothing to default it from
    given = PipelineSettings(chunks=2, schedule="1f1b", checkpoint="always")
    assert given.resolved(3, 64) == given
    # Resolving twice changes nothing: each default is decided once.
    assert resolved.resolved(7, 2) == resolved


def test_unknown_keyword_is_refused_in_one_line() -> None:
    with pytest.raises(TypeError) as caught:
        with_overrides(None, {"chunk": 4}, "plan")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("plan() got an unexpected keyword argument 'chunk'; it takes ")
    assert "chunks" in message
    with pytest.raises(TypeError, match=r"^plan\(\) got an unexpected keyword argument 'chunk'"):
        plan(linear_profile([1.0, 2.0]), 2, chunk=4)
    # A field of the runners' is no keyword of plan's: it would be ignored.
    with pytest.raises(TypeError, match="unexpected keyword argument 'granularity'"):
        plan(linear_profile([1.0, 2.0]), 2, granularity="leaves")
    with pytest.raises(TypeError, match="takes settings=PipelineSettings"):
        plan(linear_profile([1.0, 2.0]), 2, {"chunks": 2})


def test_overrides_lay_over_the_settings() -> None:
    base = PipelineSettings(chunks=4, memory="1GiB")
    laid = with_overrides(base, {"chunks": 8}, "plan")
    assert (laid.chunks, laid.memory) == (8, "1GiB")
    assert base.chunks == 4  # frozen: the caller's settings are left as they were
    assert with_overrides(base, {}, "plan") is base
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.chunks = 2  # type: ignore[misc]
    assert {"chunks", "schedule", "checkpoint", "init", "autocast"} <= FIELDS


def test_leaf_modules_are_kept_as_a_tuple() -> None:
    names = (name for name in ["a", "b"])
    assert PipelineSettings(leaf_modules=names).leaf_modules == ("a", "b")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
def test_same_plan_from_keywords_and_from_settings(seed: int) -> None:
    profile = random_profile(np.random.default_rng(seed), 9)
    keywords = {"chunks": 4, "memory": 6000, "schedule": "1f1b", "optimizer": "sgd"}
    from_keywords = plan(profile, 3, **keywords)
    from_settings = plan(profile, 3, PipelineSettings(**keywords))
    mixed = plan(profile, 3, PipelineSettings(chunks=4, memory=6000), schedule="1f1b",
                 optimizer="sgd")  # fmt: skip
    assert from_keywords.to_dict() == from_settings.to_dict() == mixed.to_dict()
    assert from_keywords.checkpoint == "except_last"  # the rule's, for 1f1b


def test_plan_defaults_follow_the_rule() -> None:
    profile = linear_profile([1.0, 2.0, 3.0, 4.0], chunks=4)
    assert plan(profile, 2).checkpoint == "except_last"
    # Zero bubble keeps everything unless told (except_last has no meaning there).
    assert plan(profile, 2, schedule="zb").checkpoint == "never"
    assert plan(profile, 2, schedule="zb", checkpoint="always").checkpoint == "always"
    assert plan(profile, 2, virtual_stages=2).checkpoint == "never"
    assert plan(profile, 2, checkpoint="always", virtual_stages=2).checkpoint == "always"


def test_search_takes_settings_and_options() -> None:
    profile = random_profile(np.random.default_rng(7), 8)
    keywords = search(profile, 4, memory=8000, optimizer="sgd", top=3, schedules=["gpipe"])
    objects = search(
        profile,
        4,
        PipelineSettings(memory=8000, optimizer="sgd"),
        SearchOptions(top=3, schedules=["gpipe"]),
    )
    assert [p.to_dict() for p in keywords] == [p.to_dict() for p in objects]
    with pytest.raises(TypeError, match=r"^search\(\) got an unexpected keyword argument 'chunks'"):
        search(profile, 4, chunks=4)
