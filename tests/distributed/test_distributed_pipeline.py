"""DistributedPipeline: equal to one process, steps refused alike, failures end every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.distributed import DistributedPipeline
from tests.support.dist_models import (
    CHUNKS,
    assert_close,
    loss_fn,
    make_batch,
    make_model,
    make_residual,
    reference_step,
    reference_steps,
)
from tests.support.dist_workers import launch, scenario_results
from tests.support.fault_workers import FAULTS, STUCK_TIMEOUT


def test_needs_process_group() -> None:
    with pytest.raises(RuntimeError, match="process group"):
        DistributedPipeline(make_model(), torch.zeros(16, 8), loss_fn=loss_fn, chunks=4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_loss_and_gradients_equal_one_process(equal_run: Any, schedule: str) -> None:
    world, results = equal_run
    loss, once, twice, _ = reference_steps()
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


def test_gathered_state_dict_is_the_original(equal_run: Any) -> None:
    _, results = equal_run
    *_, state = reference_steps()
    gathered = results[0]["state"]
    assert list(gathered) == list(state)
    for key, value in state.items():
        torch.testing.assert_close(gathered[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert all(r["state"] is None for r in results[1:])


def test_gathered_state_dict_leaves_out_what_the_model_state_dict_does(tmp_path: Path) -> None:
    """A lifted constant and a non-persistent buffer are no keys of it; a buffer no unit
    reads is, with its value."""
    from tests.support.pipeline_workers import Constants, constants_batch

    results = scenario_results("constants", 2, tmp_path, limit=120)
    model = Constants()
    x, y = constants_batch()
    loss = torch.stack(
        [loss_fn(model(xb), yb) for xb, yb in zip(x.tensor_split(2), y.tensor_split(2))]
    ).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    state = model.state_dict()
    gathered = results[0]["state"]
    assert list(gathered) == list(state)  # neither "scale" nor "shift", and "unused" too
    for key, value in state.items():
        # float64 throughout: the micro-batches' sums differ from one process's by rounding.
        torch.testing.assert_close(gathered[key], value, rtol=1e-12, atol=1e-12, msg=key)
    owns = [set(r["own"]) for r in results]
    assert owns[0] | owns[1] <= set(state) - {"unused"} and not owns[0] & owns[1]
    assert results[1]["state"] is None
    model.load_state_dict(gathered)  # strict: the same keys


LOSS_FAILURE = (
    "rank 1 (stage 1 of 2) failed in step 1: RuntimeError: deliberate failure in the loss"
)


def test_a_raising_rank_ends_every_rank(tmp_path: Path) -> None:
    runs = launch("raise", 2, tmp_path, limit=60)
    assert all(run.returncode not in (0, None) for run in runs), [r.output for r in runs]
    assert "deliberate failure in the loss" in runs[1].output
    assert "autopipe: step 1 failed on rank 1 (stage 1 of 2)" in runs[1].output
    # The other rank names the one that failed, and its error, not the lost connection.
    assert f"RuntimeError: {LOSS_FAILURE}" in runs[0].output
    assert max(run.seconds for run in runs) < 45


def test_a_stuck_rank_times_out_the_others(tmp_path: Path) -> None:
    runs = launch("stuck", 2, tmp_path, limit=60, wait_for=0)
    assert runs[0].returncode not in (0, None), runs[0].output
    assert "Timed out" in runs[0].output or "timed out" in runs[0].output
    assert f"RuntimeError: {LOSS_FAILURE}" in runs[0].output  # rank 1 recorded its error
    assert runs[1].returncode is None  # still sleeping when rank 0 gave up; killed
    assert runs[0].seconds < 30 + STUCK_TIMEOUT


@pytest.mark.parametrize("kind", FAULTS)
def test_a_fault_mid_step_is_named_on_the_other_rank(tmp_path: Path, kind: str) -> None:
    runs = launch(kind.replace(" ", "-"), 2, tmp_path, limit=60)
    assert all(run.returncode is not None for run in runs), [r.output for r in runs]
    culprit = 0 if kind == "killed in a forward" else 1
    survivor = 1 - culprit
    assert runs[survivor].returncode == 0, runs[survivor].output
    found = torch.load(tmp_path / f"rank{survivor}.pt")
    assert found is not None, "the step did not fail on the surviving rank"
    kind_, message, notes = found
    failed, stopped = (
        f"rank {culprit} (stage {culprit} of 2)",
        f"rank {survivor} (stage {survivor} of 2)",
    )
    if kind.startswith("killed"):
        assert runs[culprit].returncode == 3  # os._exit(3) in the layer's hook
        cause = "exited during step 1 without an error of its own (killed, or its process crashed)"
    else:  # the culprit raised its own error, with a note, and the survivor quotes it
        own_kind, own_message, own_notes = torch.load(tmp_path / f"rank{culprit}.pt")
        assert own_kind == "RuntimeError" and "target" in own_message, own_message
        assert own_notes == [
            f"autopipe: step 1 failed on {failed}; if another rank failed first, its log has "
            "the cause"
        ]
        cause = f"failed in step 1: {own_kind}: {own_message} (its log has the traceback)"
    assert (kind_, notes) == ("RuntimeError", []), message
    assert message == f"{failed} {cause}; {stopped} stopped waiting for it"


@pytest.fixture(scope="module")
def validity_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return scenario_results("validity", 2, tmp_path_factory.mktemp("validity"), limit=90)


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
        "inputs on the meta device on rank 0": (0, "inputs must hold values, not be on the meta"),
        "target on the meta device on the last rank": (1, "a target must hold values, not be"),
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
    from tests.support.dist_models import TwoInputs, make_concat

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


@pytest.fixture(scope="module")
def autocast_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return scenario_results("autocast", 2, tmp_path_factory.mktemp("autocast"), limit=60)


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
            assert_close(run["loss"], loss)
        for name, grad in run["grads"].items():
            assert_close(grad, once[name], name)
            seen.add(name)
        refused = result["refused"]
        assert "step runs under autocast bfloat16 but the pipeline was built for none" in refused
    assert seen == set(once)
