"""Before the stages exist: argument and size checks, and the ranks' agreement."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

from autopipe.distributed.setup import check_arguments, check_sizes
from tests.support.dist_models import loss_fn, make_model


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schedule": "zigzag"}, "unknown schedule"),
        ({"chunks": 0}, "positive integer"),
        ({"chunks": 5}, "multiple of chunks=5 and layer '3' has BatchNorm"),
        ({"chunks": 17}, "batch size 16 is smaller than chunks=17; use at most 16"),
        ({"loss_fn": 3}, "callable"),
        ({"sample": [torch.zeros(16, 2), torch.zeros(8, 2)]}, "disagree"),
    ],
)
def test_argument_checks(change: dict[str, Any], message: str) -> None:
    layers = OrderedDict(make_model().named_children())
    args = {"sample": torch.zeros(16, 8), "chunks": 4, "schedule": "1f1b", "loss_fn": loss_fn}
    args.update(change)
    problem = check_arguments(layers, plan=None, **args)
    assert problem is not None and message in problem


def test_size_checks() -> None:
    with pytest.raises(ValueError, match="chunks >= the number of stages"):
        check_sizes(4, 8, None, "1f1b", 2)
    check_sizes(4, 8, None, "gpipe", 2)
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        check_sizes(4, 3, None, "gpipe", 4)


def test_mismatches_are_reported_on_every_rank(equal_run: Any) -> None:
    world, results = equal_run
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert "different configurations" in errors["model"] and "0.weight" in errors["model"]
        assert f"process group has {world} ranks" in errors["stages"]
        assert "multiple of chunks=3" in errors["argument"]
        assert errors["argument"].startswith("rank 0: ") == (rank != 0)
