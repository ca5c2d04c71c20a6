"""A rank's build path on a group of one: settings, keywords and the checkpoint default."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopipe.distributed import DistributedPipeline
from autopipe.planning.pipeline_settings import PipelineSettings


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(
    ("given", "mode"),
    [
        ({}, "except_last"),  # 1f1b, one stage per rank
        ({"schedule": "gpipe"}, "except_last"),
        ({"virtual_stages": 2}, "never"),
        ({"checkpoint": "never"}, "never"),
    ],
)
def test_the_checkpoint_default_is_the_rule(given: dict[str, object], mode: str) -> None:
    x = torch.randn(8, 4)
    pipe = DistributedPipeline(_model(), x, loss_fn=_loss, chunks=2, **given)
    assert pipe.plan.checkpoint == mode
    assert pipe.schedule_name == given.get("schedule", "1f1b")


@pytest.mark.usefixtures("one_rank")
def test_settings_and_keywords_build_alike() -> None:
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    settings = PipelineSettings(chunks=2, schedule="gpipe", optimizer="sgd")
    by_settings = DistributedPipeline(_model().double(), x, settings, loss_fn=_loss)
    by_keywords = DistributedPipeline(
        _model().double(),
        x,
        loss_fn=_loss,
        chunks=2,
        schedule="gpipe",
        plan_options={"optimizer": "sgd"},
    )
    assert by_settings.plan.balance == by_keywords.plan.balance
    assert (by_settings.plan.optimizer, by_keywords.plan.optimizer) == ("sgd", "sgd")
    assert torch.equal(by_settings.step(x, y), by_keywords.step(x, y))


@pytest.mark.usefixtures("one_rank")
def test_unknown_keyword_is_refused_in_one_line() -> None:
    with pytest.raises(TypeError) as caught:
        DistributedPipeline(_model(), torch.randn(8, 4), loss_fn=_loss, chunks=2, granularity="x")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "DistributedPipeline() got an unexpected keyword argument 'granularity'; it takes "
    )
