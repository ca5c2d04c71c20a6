"""DistributedPipeline: equal to one process, mismatches reported, failures end every rank."""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.distributed import DistributedPipeline
from autopipe.distributed.prepared import prepare_model, shared_state
from autopipe.distributed.replicas import (
    ReplicaLayout,
    _buckets,
    check_layout,
    replica_batch,
    take_shard,
)
from autopipe.distributed.setup import LossRecorder, check_arguments, check_sizes
from autopipe.distributed.stage import (
    StageModule,
    compare_fingerprints,
    fingerprint,
    layer_output_specs,
    merge_state_dicts,
)
from autopipe.distributed.virtual import stage_indices, virtual_problem
from autopipe.planning.planner import evaluate
from tests.support.dist_workers import (
    BATCH,
    CHUNKS,
    REPLICA_CHUNKS,
    STUCK_TIMEOUT,
    UNEVEN,
    launch,
    loss_fn,
    make_batch,
    make_model,
    make_residual,
    reference_step,
    whole_batch_statistics,
)
from tests.support.planning_cases import linear_profile
from tests.support.wrap_models import ResidualMLP

# ---------------------------------------------------------------- in one process


def test_stage_module_keeps_names_and_computes_the_slice() -> None:
    model = make_model()
    model.eval()
    layers = list(model.named_children())
    stage = StageModule(layers[2:5])
    assert list(stage.state_dict()) == [
        k for k in model.state_dict() if k.split(".")[0] in {"2", "3", "4"}
    ]
    x = torch.randn(4, 16)
    torch.testing.assert_close(stage(x), model[2:5](x))


def test_stage_module_packs_tuple_inputs() -> None:
    class Add(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

    stage = StageModule([("add", Add())], tuple_input=True)
    a, b = torch.ones(2), torch.full((2,), 2.0)
    torch.testing.assert_close(stage(a, b), torch.full((2,), 3.0))


def test_output_specs_leave_model_and_rng_untouched() -> None:
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    specs = layer_output_specs(list(model), x)
    assert [s[0][0][0] for s in specs] == [(4, 16)] * 7 + [(4, 3)]
    assert all(s[0][0][1] == torch.float32 and s[0][0][2] for s in specs)
    assert not any(is_tuple for _, is_tuple in specs)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_output_specs_under_autocast_have_its_dtypes() -> None:
    specs = layer_output_specs(list(make_model(batchnorm=False)), torch.randn(4, 8), "bfloat16")
    dtypes = [s[0][0][1] for s in specs]
    # Linear computes in bfloat16, and the layers after it keep the dtype they are given.
    assert dtypes == [torch.bfloat16] * 8
    assert not torch.is_autocast_enabled("cpu")


ORDERS = {  # a stage's forwards and backwards of 4 micro-batches, as schedules run them
    "gpipe": [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)],
    "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_checkpointed_stage_module_equals_the_plain_one(mode: str, order: str) -> None:
    from autopipe.distributed.stage import StageModule

    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3)]
    xs = torch.randn(16, 8).chunk(4)
    results = []
    for checkpoint in ("never", mode):
        stage = StageModule(
            [(str(i), copy.deepcopy(layer)) for i, layer in enumerate(layers)],
            checkpoint=checkpoint,
            chunks=4,
        )
        torch.manual_seed(1)  # the same dropout masks; a re-computation replays its own
        outputs = {}
        for op, i in ORDERS[order]:
            if op == "F":
                outputs[i] = stage(xs[i])
            else:
                outputs[i].pow(2).sum().backward()
        results.append((stage, torch.cat([outputs[i] for i in range(4)])))
    (plain, out), (checkpointed, again) = results
    torch.testing.assert_close(again, out)
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values()):
        torch.testing.assert_close(b, a, msg=name)  # batch-norm statistics updated once
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    assert checkpointed.checkpointed == (4 if mode == "always" else 3)
    with pytest.raises(ValueError, match="unknown checkpoint mode 'sometimes'"):
        StageModule([], checkpoint="sometimes")


def test_merge_state_dicts_rejects_overlap() -> None:
    merged = merge_state_dicts([{"0.weight": 1}, {"2.weight": 2}])
    assert list(merged) == ["0.weight", "2.weight"]
    with pytest.raises(ValueError, match=r"0\.weight"):
        merge_state_dicts([{"0.weight": 1}, {"0.weight": 2}])


def test_fingerprints_name_the_difference() -> None:
    a = fingerprint(OrderedDict(make_model().named_children()), chunks=4)
    b = fingerprint(OrderedDict(make_model(width=12).named_children()), chunks=4)
    assert compare_fingerprints([a, a]) is None
    message = compare_fingerprints([a, a, b])
    assert message is not None and "rank 2" in message and "0.weight" in message
    assert "chunks" in (compare_fingerprints([a, {**a, "chunks": 2}]) or "")


def test_loss_recorder_scales_and_averages() -> None:
    recorder = LossRecorder(lambda out, tgt: (out - tgt).abs().sum(), chunks=2)
    assert recorder(torch.tensor(3.0), torch.tensor(1.0)).item() == 1.0
    recorder(torch.tensor(5.0), torch.tensor(1.0))
    assert recorder.mean().item() == 3.0


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


def test_virtual_stage_checks() -> None:
    check_sizes(2, 8, _tiny_plan(stages=4), "1f1b", 4, virtual_stages=2)
    check_sizes(2, 8, None, "1f1b", 1, virtual_stages=2)  # one round: any chunks fit
    with pytest.raises(ValueError, match="plan has 2 stages but virtual_stages=2"):
        check_sizes(2, 8, _tiny_plan(), "1f1b", 4, virtual_stages=2)
    with pytest.raises(ValueError, match="cannot split 8 layers into 12 stages"):
        check_sizes(4, 8, None, "gpipe", 4, virtual_stages=3)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        check_sizes(2, 8, None, "1f1b", 5, virtual_stages=2)
    check_sizes(2, 8, None, "gpipe", 5, virtual_stages=2)  # looped BFS takes any chunks
    assert stage_indices(1, 3, 2) == [1, 4]
    assert virtual_problem(0) is not None and virtual_problem(2) is None


def test_replica_checks() -> None:
    check_sizes(2, 8, None, "1f1b", 2, data_parallel=2)  # 1f1b needs chunks >= K, not K·D
    with pytest.raises(ValueError, match="4 ranks = 2 replicas of 2 stages"):
        check_sizes(2, 8, _tiny_plan(data_parallel=2, stages=4), "gpipe", 4, data_parallel=2)
    assert check_layout(6, 3, None, None) == 2
    with pytest.raises(ValueError, match="not a multiple of data_parallel=4"):
        check_layout(6, 4, 4, None)
    with pytest.raises(ValueError, match="plan was made for data_parallel=1"):
        check_layout(4, 2, 2, _tiny_plan())
    assert check_layout(4, 2, None, _tiny_plan(data_parallel=2)) == 2  # D from the plan


def _tiny_plan(data_parallel: int = 1, stages: int = 2) -> Any:
    profile = linear_profile([1.0] * 8)
    return evaluate(profile, [8 // stages] * stages, data_parallel=data_parallel)


def test_replica_batch_and_shards() -> None:
    assert replica_batch(16, 2, 4, None) == 8  # a multiple of D·chunks: the global batch
    assert replica_batch(12, 2, 4, None) == 12  # else one replica's shard
    assert replica_batch(16, 1, 4, None) == 16
    layout = ReplicaLayout(2, 2, 1, 1, None, None)
    x = torch.arange(16.0).unsqueeze(1)
    torch.testing.assert_close(take_shard(x, layout, 8, "inputs"), x[8:])
    pair = take_shard((x, x), layout, 8, "inputs")
    assert isinstance(pair, tuple) and torch.equal(pair[1], x[8:])
    assert take_shard(x[:8], layout, 8, "inputs") is not None
    with pytest.raises(ValueError, match=r"batch size 16 .* or 8 "):
        take_shard(x[:4], layout, 8, "inputs")


def test_buckets_split_by_size_and_dtype() -> None:
    tensors = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(1)]
    sizes = [[t.numel() for t in bucket] for bucket in _buckets(tensors, limit=32)]
    assert sizes == [[4, 4], [4], [1]]
    assert [len(b) for b in _buckets(tensors, limit=16)] == [1, 1, 1, 1]


def test_non_sequential_models_are_wrapped_or_rejected() -> None:
    model = ResidualMLP()
    x = torch.randn(4, 5)
    prepared = prepare_model(model, x)
    assert prepared.wrapped and len(prepared.sequential) == 6
    value: Any = prepared.flatten(x)
    for unit in prepared.sequential:
        value = unit(value)
    torch.testing.assert_close(prepared.rebuild(value, True), model(x))
    with pytest.raises(ValueError, match="pass an nn.Sequential"):
        prepare_model(nn.Linear(2, 2), [x])


def test_shared_parameters_across_stages_are_refused() -> None:
    shared = nn.Linear(4, 4)
    layers = [shared, nn.ReLU(), nn.Linear(4, 4)]
    layers[2].weight = shared.weight
    assert shared_state(layers, [1, 2]) is not None
    assert shared_state(layers, [3]) is None


def test_needs_process_group() -> None:
    with pytest.raises(RuntimeError, match="process group"):
        DistributedPipeline(make_model(), torch.zeros(16, 8), loss_fn=loss_fn, chunks=4)


# ---------------------------------------------------------------- over processes (gloo)


def _results(scenario: str, world: int, workdir: Path, limit: float) -> list[Any]:
    """Runs a scenario on ``world`` spawned ranks; every rank must succeed; their results."""
    runs = launch(scenario, world, workdir, limit=limit)
    for rank, run in enumerate(runs):
        assert run.returncode == 0, f"rank {rank} failed:\n{run.output[-3000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def equal_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    workdir = tmp_path_factory.mktemp(f"equal{world}")
    return world, _results("equal", world, workdir, limit=80)


@functools.cache
def _reference() -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Loss and gradients after one reference step, gradients and state after two."""
    model = make_model()
    x, y = make_batch()
    loss = reference_step(model, x, y)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    reference_step(model, x, y)
    twice = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, once, twice, model.state_dict()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_loss_and_gradients_equal_one_process(equal_run: Any, schedule: str) -> None:
    world, results = equal_run
    loss, once, twice, _ = _reference()
    assert results[-1][schedule]["loss"] is not None
    torch.testing.assert_close(results[-1][schedule]["loss"], loss, rtol=1e-5, atol=1e-6)
    assert all(r[schedule]["loss"] is None for r in results[:-1])
    seen: dict[str, Tensor] = {}
    for rank in results:
        assert len(rank[schedule]["balance"]) == world
        for name, grad in rank[schedule]["grads"].items():
            torch.testing.assert_close(grad, once[name], rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(
                rank[schedule]["twice"][name], twice[name], rtol=1e-5, atol=1e-6, msg=name
            )
            seen[name] = grad
    assert sorted(seen) == sorted(once)  # every parameter lives on exactly one rank


@pytest.mark.parametrize(
    "key", ["always 1f1b", "except_last gpipe", "auto 1f1b", "except_last gpipe x2"]
)
def test_checkpointed_stages_equal_one_process(equal_run: Any, key: str) -> None:
    world, results = equal_run
    loss, once, twice, state = _reference()
    runs = [rank["checkpointed"][key] for rank in results]
    torch.testing.assert_close(runs[-1]["loss"], loss, rtol=1e-5, atol=1e-6)
    for run in runs:
        for name, grad in run["grads"].items():
            torch.testing.assert_close(grad, once[name], rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(run["twice"][name], twice[name], rtol=1e-5, atol=1e-6)
    # Batch-norm statistics were updated once per step, not again when recomputed.
    gathered = runs[0]["state"]
    for name, value in state.items():
        torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-6, msg=name)
    mode = key.split()[0]
    stages = world * (2 if key.endswith("x2") else 1)
    counts = [count for run in runs for _, count in run["checkpointed"]]
    if mode == "always":  # every micro-batch of both steps, on every stage
        assert counts == [2 * CHUNKS] * stages
    elif mode == "except_last":
        assert counts == [2 * (CHUNKS - 1)] * stages
        # It spares the micro-batch whose backward comes first: torch's GPipe goes
        # backward in order, looped BFS in reverse.
        first = CHUNKS - 1 if key.endswith("x2") else 0
        assert [s for run in runs for s in run["spared"]] == [first] * stages
    else:  # no memory limit: auto needs no re-computation
        assert runs[0]["plan"] == "auto" and counts == [0] * stages


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


def test_unknown_checkpoint_mode_is_refused(equal_run: Any) -> None:
    _, results = equal_run
    for rank in results:
        assert "unknown checkpoint mode 'sometimes'" in rank["checkpointed"]["error"]


def test_ranks_calibrate_links_and_runner_alike(equal_run: Any) -> None:
    _, results = equal_run
    found = [r["calibration"] for r in results]
    values = found[0]["values"]
    assert all(f["values"] == values for f in found)  # every rank plans with the same figures
    assert values["latency_s"] >= 0 and values["bandwidth"] > 0
    assert values["allreduce_bandwidth"] > 0 and values["overhead_s"] >= 0
    assert values["virtual_overhead_s"] >= 0  # torch's runtime for two stages per rank
    assert values["compute_scale"] > 0 and values["fixed_scale"] > 0
    assert values["alone_compute_scale"] > 0 and values["alone_fixed_scale"] > 0
    # The planner charges the measured all-reduce: 2·(D−1)/D · params / bandwidth.
    expected = found[0]["params"] / values["allreduce_bandwidth"]
    assert found[0]["allreduce"] == pytest.approx(expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_wrapped_residual_model_equals_one_process(equal_run: Any, schedule: str) -> None:
    world, results = equal_run
    model = make_residual()
    x, y = make_batch()
    loss = reference_step(model, x[:, :5], y)
    key = f"wrapped {schedule}"
    torch.testing.assert_close(results[-1][key]["loss"], loss, rtol=1e-5, atol=1e-6)
    seen = set()
    for rank in results:
        assert len(rank[key]["balance"]) == world
        for name, grad in rank[key]["grads"].items():
            reference = model.get_parameter(name).grad
            torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == {name for name, _ in model.named_parameters()}
    assert list(results[0][key]["state"]) == list(model.state_dict())


@pytest.mark.parametrize("kind", ["sequential", "wrapped"])
def test_uneven_micro_batches_equal_one_process(equal_run: Any, kind: str) -> None:
    _, results = equal_run
    x, y = make_batch()
    x, y = x[:UNEVEN], y[:UNEVEN]
    model = make_model(batchnorm=False) if kind == "sequential" else make_residual()
    x = x if kind == "sequential" else x[:, :5]
    loss = reference_step(model, x, y)  # the same micro-batches: 4, 4, 3, 3 rows
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(results[-1]["uneven"][kind]["loss"], loss, rtol=1e-5, atol=1e-6)
    if kind == "sequential":  # a second step adds the same gradients again
        reference_step(model, x, y)
    seen = set()
    for rank in results:
        part = rank["uneven"][kind]
        for name, grad in part["grads"].items():
            torch.testing.assert_close(grad, once[name], rtol=1e-5, atol=1e-6, msg=name)
            if kind == "sequential":
                twice = model.get_parameter(name).grad
                torch.testing.assert_close(part["twice"][name], twice, rtol=1e-5, atol=1e-6)
            seen.add(name)
    assert seen == set(once)


def test_uneven_micro_batches_are_planned_padded(equal_run: Any) -> None:
    _, results = equal_run
    planned, padded, full = results[0]["uneven"]["plan"]
    # 4, 4, 3 and 3 rows run as 4 each: timed as 4 micro-batches of 4, not their mean.
    assert planned == pytest.approx(padded) and padded == pytest.approx(full)


def test_uneven_micro_batches_with_batchnorm_are_refused(equal_run: Any) -> None:
    _, results = equal_run
    for rank in results:
        message = rank["uneven"]["batchnorm"]
        assert f"batch size {UNEVEN} is not a multiple of chunks=4" in message
        assert "'3' has BatchNorm" in message and "padding rows" in message


def test_gathered_state_dict_is_the_original(equal_run: Any) -> None:
    _, results = equal_run
    *_, state = _reference()
    gathered = results[0]["state"]
    assert list(gathered) == list(state)
    for key, value in state.items():
        torch.testing.assert_close(gathered[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert all(r["state"] is None for r in results[1:])


def test_mismatches_are_reported_on_every_rank(equal_run: Any) -> None:
    world, results = equal_run
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert "different configurations" in errors["model"] and "0.weight" in errors["model"]
        assert f"process group has {world} ranks" in errors["stages"]
        assert "multiple of chunks=3" in errors["argument"]
        assert errors["argument"].startswith("rank 0: ") == (rank != 0)


def test_a_raising_rank_ends_every_rank(tmp_path: Path) -> None:
    runs = launch("raise", 2, tmp_path, limit=60)
    assert all(run.returncode not in (0, None) for run in runs), [r.output for r in runs]
    assert "deliberate failure in the loss" in runs[1].output
    assert "autopipe: step 1 failed on rank 0" in runs[0].output
    assert max(run.seconds for run in runs) < 45


def test_a_stuck_rank_times_out_the_others(tmp_path: Path) -> None:
    runs = launch("stuck", 2, tmp_path, limit=60, wait_for=0)
    assert runs[0].returncode not in (0, None), runs[0].output
    assert "Timed out" in runs[0].output or "timed out" in runs[0].output
    assert runs[1].returncode is None  # still sleeping when rank 0 gave up; killed
    assert runs[0].seconds < 30 + STUCK_TIMEOUT


@pytest.fixture(scope="module")
def validity_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _results("validity", 2, tmp_path_factory.mktemp("validity"), limit=90)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_step_refused_on_one_rank_is_refused_on_every_rank(
    validity_run: list[dict[str, Any]], schedule: str
) -> None:
    runs = [rank[schedule] for rank in validity_run]
    expected = {
        "bad batch on rank 0": (0, "inputs must have batch size 16"),
        "wrong feature size": (0, "inputs has shape (16, 5) and dtype torch.float32 but"),
        "wrong dtype": (0, "dtype torch.float64 but the pipeline was built for shape (N, 8)"),
        "bad target on the last rank": (1, "a target must have batch size 16"),
        "target tuple on the last rank": (1, "target must be a single tensor"),
    }
    for name, (culprit, message) in expected.items():
        for rank, run in enumerate(runs):
            assert run["errors"][name] is not None, (name, rank)
            kind, error = run["errors"][name]
            assert kind == "ValueError" and message in error, (name, rank, error)
            assert error.startswith(f"rank {culprit}: ") == (rank != culprit), error
    # An error of another kind reaches its own rank as it is, and the others as ValueError.
    failed = [run["errors"]["failure moving the inputs on rank 0"] for run in runs]
    assert failed[0] == ("RuntimeError", "deliberate failure moving the inputs")
    assert failed[1] == ("ValueError", "rank 0: RuntimeError: deliberate failure moving the inputs")
    # The step after a refused one is exact, and refused steps left no gradient behind.
    model = make_model()
    x, y = make_batch(seed=2)
    loss = reference_step(model, x, y)
    reference_step(model, x, y)
    assert runs[0]["losses"] == [None, None]
    for value in runs[1]["losses"]:
        torch.testing.assert_close(value, loss, rtol=1e-5, atol=1e-6)
    for run in runs:
        for name, grad in run["grads"].items():
            expected_grad = model.get_parameter(name).grad
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6, msg=name)


def _plain_step(model: nn.Module, args: tuple[Any, ...], y: Tensor) -> Tensor:
    """The plain model called as model(*args) on each micro-batch; the mean loss, backward."""

    def split(value: Any) -> list[Any]:
        if isinstance(value, Tensor):
            return list(value.tensor_split(CHUNKS))
        return list(zip(*(split(v) for v in value)))

    pieces = [split(value) for value in args]
    losses = [
        loss_fn(model(*(part[i] for part in pieces)), target)
        for i, target in enumerate(y.tensor_split(CHUNKS))
    ]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach()


def test_samples_are_the_models_positional_inputs(validity_run: list[dict[str, Any]]) -> None:
    from tests.support.dist_workers import TwoInputs, make_concat

    x, y = make_batch()
    b = make_batch(seed=3)[1]
    cases = {
        "one tensor in a tuple": (make_model(), [(x,), (x,)]),  # step((x,)) and step(x)
        "two inputs": (TwoInputs(), [(x, b)]),
        "one tuple": (make_concat(), [((x, b),)]),
    }
    for name, (model, steps) in cases.items():
        runs = [rank["samples"][name] for rank in validity_run]
        losses = [_plain_step(model, args, y) for args in steps]
        assert runs[0]["losses"] == [None] * len(steps), name
        for found, loss in zip(runs[1]["losses"], losses, strict=True):
            torch.testing.assert_close(found, loss, rtol=1e-5, atol=1e-6, msg=name)
        seen = set()
        for run in runs:
            for key, grad in run["grads"].items():
                reference = model.get_parameter(key).grad
                torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6, msg=key)
                seen.add(key)
        assert seen == {key for key, _ in model.named_parameters()}, name
    for rank in validity_run:
        message = rank["samples"]["several inputs"]
        assert "an nn.Sequential takes one input, not 2" in message and "((a, b),)" in message


# ---------------------------------------------------------------- replicas: K·D ranks


@pytest.fixture(scope="module")
def replica_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("replicas")
    return _results("replicas", 4, workdir, limit=90)


@functools.cache
def _replica_reference(d: int = 2) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor], Any]:
    """One process: loss and gradients after one step, gradients and state after two.

    Gradients: the mean over all D·M micro-batch losses, replica r's micro-batches being
    ``x[r*b:(r+1)*b].tensor_split(M)``, back-propagated once per step. BatchNorm
    statistics: one update per step from the global mini-batch.
    """
    model = make_model()
    x, y = make_batch()
    b = BATCH // d
    shards = [(x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]) for r in range(d)]

    def step() -> Tensor:
        m = REPLICA_CHUNKS
        split = [(xs.tensor_split(m), ys.tensor_split(m)) for xs, ys in shards]
        pairs = [pair for xs, ys in split for pair in zip(xs, ys)]
        with whole_batch_statistics(model):
            loss = torch.stack([loss_fn(model(xb), yb) for xb, yb in pairs]).mean()
            loss.backward()
        return loss.detach()

    loss = step()
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    step()
    twice = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, once, twice, model.state_dict()


def _close(actual: Tensor, expected: Tensor, name: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replicas_equal_one_process(replica_run: list[dict[str, Any]], schedule: str) -> None:
    loss, once, twice, state = _replica_reference()
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    for rank, result in enumerate(replica_run):
        run, replica = result[schedule], rank // 2
        if rank % 2:  # the last stage of each replica: the loss of all replicas
            _close(run["loss"], loss)
            _close(run["shard loss"], loss)  # each replica's shard instead of the global batch
        else:
            assert run["loss"] is None and run["shard loss"] is None
        for name, grad in run["grads"].items():
            _close(grad, once[name], name)
            _close(run["twice"][name], twice[name], name)  # added up, not averaged again
            _close(run["shard"][name], once[name], name)
            _close(run["unequal"][name], once[name] + replica + 1, name)
            seen[replica].add(name)
        for key, value in run["own state"].items():  # every replica holds the same state
            _close(value, state[key], key)
    assert seen[0] == seen[1] == set(once)
    gathered = replica_run[0][schedule]["state"]
    assert list(gathered) == list(state)
    for key, value in state.items():
        _close(gathered[key], value, key)
    assert all(r[schedule]["state"] is None for r in replica_run[1:])


def test_replica_layout_and_plan(replica_run: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(replica_run):
        data_parallel, global_batch, batch, text = result["layout"]
        assert (data_parallel, global_batch, batch) == (2, BATCH, BATCH // 2)
        assert f"stage {rank % 2}/2, replica {rank // 2}/2" in text


def test_replica_mismatches_are_reported_on_every_rank(replica_run: list[dict[str, Any]]) -> None:
    for result in replica_run:
        errors = result["errors"]
        assert "batch size 16" in errors["step"] and "or 8" in errors["step"]
        assert "4 ranks, not a multiple of data_parallel=3" in errors["world"]
        assert "plan was made for data_parallel=1 but data_parallel=2" in errors["plan"]
        assert "data_parallel differs between rank 0 and rank 1" in errors["ranks"]


# ---------------------------------------------------------------- virtual stages: K·v stages


@pytest.fixture(scope="module")
def virtual_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("virtual")
    return _results("virtual", 2, workdir, limit=60)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_virtual_stages_equal_one_process(virtual_run: list[dict[str, Any]], schedule: str) -> None:
    loss, once, twice, state = _reference()
    seen: set[str] = set()
    for rank, result in enumerate(virtual_run):
        run = result[schedule]
        indices, first, last, text = run["layout"]
        assert indices == [rank, rank + 2] and (first, last) == (rank == 0, rank == 1)
        assert f"stage {rank}/2, virtual_stages=2 [{rank}, {rank + 2}]" in text
        assert len(run["balance"]) == 4  # the plan balances K·v stages
        virtual, predicted, replayed = run["plan"]  # and predicts the interleaved schedule
        assert virtual == 2 and predicted == pytest.approx(replayed)
        if rank == 1:  # holds the last stage, 3
            _close(run["loss"], loss)
        else:
            assert run["loss"] is None
        for name, grad in run["grads"].items():
            _close(grad, once[name], name)
            _close(run["twice"][name], twice[name], name)
            seen.add(name)
        own = sum(once[name].numel() for name in run["grads"])
        assert run["optimized"] == own  # module.parameters() holds both stages' parameters
    assert seen == set(once)
    gathered = virtual_run[0][schedule]["state"]
    assert list(gathered) == list(state)
    for key, value in state.items():
        _close(gathered[key], value, key)
    assert virtual_run[1][schedule]["state"] is None


def test_virtual_stage_mismatches_are_reported_on_every_rank(
    virtual_run: list[dict[str, Any]],
) -> None:
    for result in virtual_run:
        errors = result["errors"]
        assert "plan has 2 stages but virtual_stages=2 on 2 ranks" in errors["stages"]
        assert "K·v = 4" in errors["stages"]
        assert "chunks=5" in errors["chunks"] and "rounds" in errors["chunks"]
        assert "virtual_stages differs between rank 0 and rank 1" in errors["ranks"]
        assert "plan was made for virtual_stages=4 but the pipeline runs" in errors["planned"]


@pytest.fixture(scope="module")
def autocast_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _results("autocast", 2, tmp_path_factory.mktemp("autocast"), limit=60)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_autocast_equals_one_process_under_autocast(
    autocast_run: list[dict[str, Any]], schedule: str
) -> None:
    model = make_model()
    x, y = make_batch()
    losses = []
    # Micro-batch by micro-batch, each back-propagated alone (their gradients added in
    # float32), as the stages run them.
    for xb, yb in zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(loss_fn(model(xb), yb))
        (losses[-1] / CHUNKS).backward()
    loss = torch.stack(losses).mean().detach()
    once = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    seen: set[str] = set()
    for rank, result in enumerate(autocast_run):
        run = result[schedule]
        assert run["plan"]["autocast"] == "bfloat16"
        if rank == 1:
            _close(run["loss"], loss)
        for name, grad in run["grads"].items():
            _close(grad, once[name], name)
            seen.add(name)
        refused = result["refused"]
        assert "step runs under autocast bfloat16 but the pipeline was built for none" in refused
    assert seen == set(once)
