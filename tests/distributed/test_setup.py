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


@pytest.fixture
def one_rank(tmp_path: Any) -> Any:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_rank0_plans_tensor_parallel_stages_as_the_search_prices_their_mesh() -> None:
    # tensor_parallel=2: rank 0 counts the shards of the model's own plan and plans
    # Mesh(tensor=2), the plan the search makes of t=2 x K=2 x D=1 from that profile.
    pytest.importorskip("transformers")
    from autopipe.distributed.prepared import prepare_model
    from autopipe.distributed.setup import setup_on_rank0
    from autopipe.planning import Mesh, PipelineSettings, SearchOptions, search
    from profiler import Profile
    from tests.support.tp_workers import batch, tiny_llama

    x, _ = batch()
    prepared = prepare_model(tiny_llama(), x)
    settings = PipelineSettings(chunks=2, schedule="1f1b", tensor_parallel=2)
    made, _ = setup_on_rank0(
        prepared, prepared.sample, 2, torch.device("cpu"), None, None, settings
    )
    assert made.mesh == Mesh(tensor=2)
    profile = Profile.from_dict(made.profile)
    assert all(layer.shards is not None for layer in profile.layers)
    options = SearchOptions(
        schedules=("1f1b",), checkpoints=(made.checkpoint,), top=1000, tensor_parallel=(2,),
        micro_batch=made.micro_batch,
    )  # fmt: skip
    found = [
        p for p in search(profile, 4, options=options) if (p.num_stages, p.data_parallel) == (2, 1)
    ]
    assert len(found) == 1 and found[0].mesh == made.mesh
    assert (found[0].balance, found[0].chunks) == (made.balance, made.chunks)
    assert made.step_time == pytest.approx(found[0].step_time, rel=1e-12)
    assert [s.memory for s in made.stages] == pytest.approx([s.memory for s in found[0].stages])
    # The unsharded plan of the same profile prices other stages.
    whole, _ = setup_on_rank0(
        prepared, prepared.sample, 2, torch.device("cpu"), None, profile,
        PipelineSettings(chunks=2, schedule="1f1b"),
    )  # fmt: skip
    assert whole.mesh == Mesh() and whole.step_time != made.step_time
