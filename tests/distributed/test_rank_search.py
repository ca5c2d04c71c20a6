"""The searched configuration, built on every rank; the settings and options it searches under."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopipe.distributed.rank_search import search_plan
from autopipe.planning.configuration.config_search import SearchOptions
from autopipe.planning.pipeline_settings import PipelineSettings
from profiler.measure import profile_model
from tests.support.dist_models import make_batch, make_model, reference_step


def test_searched_configuration_equals_one_process(equal_run: Any) -> None:
    world, results = equal_run
    runs = [rank["searched"] for rank in results]
    devices, replicas, chunks, _ = runs[0]["config"]
    assert devices == world and all(run["config"] == runs[0]["config"] for run in runs)
    # D replicas of M micro-batches: the mean loss over D·M equal micro-batches, in order.
    model = make_model()
    x, y = make_batch()
    loss = reference_step(model, x, y, chunks=replicas * chunks)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    last = [run["loss"] for run in runs if run["loss"] is not None]
    assert last and all(torch.allclose(value, loss, rtol=1e-5, atol=1e-6) for value in last)
    for run in runs:
        for name, grad in run["grads"].items():
            torch.testing.assert_close(grad, once[name], rtol=1e-5, atol=1e-6, msg=name)
    assert "rank 0 found no configuration" in runs[0]["error"]


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _small() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(8, 4)


@pytest.mark.usefixtures("one_rank")
def test_settings_and_options_search_as_their_keywords_do() -> None:
    model, x = _small()
    profile = profile_model(model, (x,), device="cpu", batch_sizes=[1, 2, 4, 8])
    by_keywords = search_plan(model, x, profile=profile, schedules=["gpipe"], memory="1GiB")
    whole = search_plan(
        model,
        x,
        profile=profile,
        settings=PipelineSettings(memory="1GiB"),
        options=SearchOptions(schedules=["gpipe"]),
    )
    assert whole.to_dict() == by_keywords.to_dict() and whole.schedule == "gpipe"
    assert whole.batch_size == 8 and whole.num_devices == 1
    with pytest.raises(ValueError, match="rank 0 found no configuration"):
        search_plan(model, x, profile=profile, settings=PipelineSettings(memory=100))


@pytest.mark.usefixtures("one_rank")
def test_other_keywords_and_types_are_refused() -> None:
    model, x = _small()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'chunks'.*memory"):
        search_plan(model, x, chunks=2)
    with pytest.raises(TypeError, match=r"takes options=SearchOptions"):
        search_plan(model, x, options={"schedules": ["gpipe"]})  # type: ignore[arg-type]
