"""Stages that re-compute single units (a plan's checkpoint ``units``) train exactly as the
plain model: StageModule in one process, DistributedPipeline on 2 gloo ranks (float64, SGD).

(Not named after a module: ``unit_recompute`` and ``recomputed_units`` are modules of other
packages, and a test named after a module sits in the folder mirroring it, see
tests/test_layout.py.)"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from autopipe.distributed.stage import StageModule
from tests.support.dist_workers import scenario_results
from tests.support.unit_recompute_workers import (
    CHUNKS,
    STEPS,
    Flags,
    bench_blocks,
    per_micro_batch_reference,
    reference,
)

WORLD = 2

ORDERS = {  # a stage's forwards and backwards of 4 micro-batches, as schedules run them
    "gpipe": [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)],
    "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
}


def _close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_stage_re_computing_units_equals_the_plain_one(order: str) -> None:
    torch.manual_seed(0)
    layers = [
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), Flags(), nn.ReLU(),
        nn.Linear(16, 3),
    ]  # fmt: skip
    xs = torch.randn(16, 8).chunk(4)
    results = []
    for checkpoint, units in (("never", []), ("units", [1, 2, 3, 5])):
        stage = StageModule(
            [(str(i), copy.deepcopy(layer)) for i, layer in enumerate(layers)],
            checkpoint=checkpoint,
            chunks=4,
            units=units,
        )
        torch.manual_seed(1)  # the same dropout masks; a re-computation replays its own
        outputs = {}
        for op, i in ORDERS[order]:
            if op == "F":
                outputs[i] = stage(xs[i])
            else:
                outputs[i].pow(2).sum().backward()
        results.append((stage, torch.cat([outputs[i] for i in range(4)])))
    (plain, out), (units_stage, again) = results
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    for (name, a), b in zip(plain.state_dict().items(), units_stage.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)  # statistics updated once
    for a, b in zip(plain.parameters(), units_stage.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
    assert units_stage.checkpointed == 4 * 4  # four units on every micro-batch
    flags = units_stage.get_submodule("3")
    assert isinstance(flags, Flags)
    # Each micro-batch's forward is checkpointed, and runs again marked as re-computing.
    assert sorted(flags.seen) == [(False, True)] * 4 + [(True, False)] * 4
    kept = plain.get_submodule("3")
    assert isinstance(kept, Flags) and kept.seen == [(False, False)] * 4


def test_units_run_plainly_without_gradients_and_in_eval() -> None:
    stage = StageModule([("0", nn.Linear(2, 2)), ("1", Flags())], checkpoint="units", units=[1])
    with torch.no_grad():
        stage(torch.randn(3, 2))
    stage.eval()
    stage(torch.randn(3, 2))
    assert stage.checkpointed == 0


def test_a_unit_modifying_its_input_in_place_is_refused() -> None:
    stage = StageModule(
        [("0", nn.Linear(2, 2)), ("1", nn.LeakyReLU(inplace=True))], checkpoint="units", units=[1]
    )
    with pytest.raises(RuntimeError, match="layer '1'.*modifies its input in place"):
        stage(torch.randn(3, 2))


@pytest.mark.parametrize(
    ("checkpoint", "units", "message"),
    [
        ("units", [], "exactly when its checkpoint is 'units'"),
        ("never", [0], "exactly when its checkpoint is 'units'"),
        ("units", [2], r"distinct layers of the stage \(0 to 1\), ascending"),
        ("units", [1, 0], "ascending"),
        ("auto", [], "unknown checkpoint mode 'auto' for a stage"),
    ],
)
def test_inconsistent_units_are_refused(checkpoint: str, units: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StageModule([("0", nn.Tanh()), ("1", nn.Tanh())], checkpoint=checkpoint, units=units)


@pytest.fixture(scope="module")
def units_run(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    workdir = tmp_path_factory.mktemp("units")
    return scenario_results("unit-recompute", WORLD, workdir, limit=400)


def _check_run(results: list[Any], key: Any, kind: str, chunks: int = CHUNKS) -> None:
    """Every rank's losses and parameters after each step, and the gathered state (buffers
    included), equal the plain model's (on the mean of ``chunks`` micro-batches' losses)."""
    steps, state = reference(kind, chunks)
    for rank, result in enumerate(results):
        run = result[key]
        for step in range(STEPS):
            got, want = run["steps"][step], steps[step]
            if run["last"]:
                _close(got["loss"], want["loss"], f"{key} loss {step}")
            else:
                assert got["loss"] is None
            for name, value in got["params"].items():
                _close(value, want["params"][name], f"{key} rank {rank} {name} step {step}")
        # Each stage module re-computes the units its stage of the plan lists.
        for (mode, units, _), (start, listed) in zip(run["checkpointed"], run["planned"]):
            assert list(units) == [u - start for u in listed] and (mode == "units") == bool(units)
    held = {name for result in results for name in result[key]["steps"][-1]["params"]}
    assert held == set(steps[-1]["params"]) or not held  # sharded replicas: state only
    gathered = results[0][key]["state"]
    assert set(gathered) == set(state)
    for name, value in state.items():
        _close(gathered[name], value, f"{key} {name}")


def _recomputed(results: list[Any], key: Any) -> list[tuple[str, tuple[int, ...], int]]:
    return [entry for result in results for entry in result[key]["checkpointed"]]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb"])
def test_units_on_both_stages_train_as_the_plain_model(units_run: Any, schedule: str) -> None:
    _check_run(units_run, ("blocks", schedule), "blocks")
    # Stage 0 re-computes units 0, 2, 3 and stage 1 units 4, 7, on every micro-batch.
    assert _recomputed(units_run, ("blocks", schedule)) == [
        ("units", (0, 2, 3), 3 * CHUNKS * STEPS),
        ("units", (0, 3), 2 * CHUNKS * STEPS),
    ]


def test_units_of_sharded_replicas(units_run: Any) -> None:
    # One stage, two replicas of 4 micro-batches each: the plain model's mean of 8.
    _check_run(units_run, ("blocks", "zero 3"), "blocks", chunks=WORLD * CHUNKS)
    assert (
        _recomputed(units_run, ("blocks", "zero 3"))
        == [("units", (0, 3, 5), 3 * CHUNKS * STEPS)] * WORLD
    )


def test_units_beside_a_whole_stage_mode(units_run: Any) -> None:
    _check_run(units_run, ("blocks", "mixed"), "blocks")
    assert _recomputed(units_run, ("blocks", "mixed")) == [
        ("units", (1, 4), 2 * CHUNKS * STEPS),
        ("except_last", (), (CHUNKS - 1) * STEPS),
    ]


def test_batch_norm_units_update_statistics_once(units_run: Any) -> None:
    # Deferred (the default): once per step from the whole batch, as the reference.
    _check_run(units_run, ("batchnorm", "deferred"), "batchnorm")
    # Not deferred: once per micro-batch, as the plain model running them one by one.
    gathered = units_run[0]["batchnorm", "per micro-batch"]["state"]
    for name, value in per_micro_batch_reference("batchnorm").items():
        _close(gathered[name], value, name)
    assert gathered["3.num_batches_tracked"].item() == STEPS * CHUNKS


def test_dropout_units_replay_their_random_numbers(units_run: Any) -> None:
    for result in units_run:
        kept, units = result["dropout", "never"], result["dropout", "units"]
        assert [m for m, *_ in units["checkpointed"]] == ["units"]
        for step in range(STEPS):
            if kept["last"]:
                _close(units["steps"][step]["loss"], kept["steps"][step]["loss"], "loss")
            for name, value in kept["steps"][step]["params"].items():
                _close(units["steps"][step]["params"][name], value, name)
    # The recording layer (re-computed on rank 0): checkpointed once and re-computed once
    # per micro-batch, besides the plain forward that measured the boundary shapes.
    flags = units_run[0]["dropout", "units"]["flags"]
    per_step = [(True, False)] * CHUNKS + [(False, True)] * CHUNKS
    assert sorted(flags) == sorted([(False, False)] + per_step * STEPS)
    assert set(units_run[0]["dropout", "never"]["flags"]) == {(False, False)}


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        (("blocks v2", "1f1b"), "blocks"),
        (("blocks v2", "gpipe"), "blocks"),
        (("batchnorm v2", "1f1b"), "batchnorm"),
    ],
)
def test_interleaved_virtual_stages_re_compute_units(units_run: Any, key: Any, kind: str) -> None:
    _check_run(units_run, key, kind)
    assert [r[key]["stages"] for r in units_run] == [[0, 2], [1, 3]]
    counted = [n for result in units_run for _, units, n in result[key]["checkpointed"]]
    modes = [len(units) for result in units_run for _, units, _ in result[key]["checkpointed"]]
    assert counted == [size * CHUNKS * STEPS for size in modes] and sum(modes) > 0


@pytest.mark.parametrize("virtual", [1, 2])
def test_a_plan_made_with_auto_and_a_memory_cap_runs_as_planned(
    units_run: Any, virtual: int
) -> None:
    planned = units_run[0]["planned"][virtual]
    assert planned is not None, "no cap made checkpoint='auto' re-compute units"
    assert "units" in planned["planned"]
    for source in ("given", "own"):  # given as plan=, and planned by the runner itself
        key = ("planned", virtual, source)
        results = [{key: result["planned"][virtual][source]} for result in units_run]
        _check_run(results, key, "blocks")
        assert results[0][key]["modes"] == planned["planned"]


def test_inconsistent_plans_are_refused_on_every_rank(units_run: Any) -> None:
    for result in units_run:
        errors = result["errors"]
        assert "checkpoint='units' is a stage's mode that a plan chooses" in errors["setting"]
        assert (
            "stage 1 of the plan: checkpoint 'units' with re-computed units []" in errors["empty"]
        )
        assert "re-create the plan" in errors["empty"]
        assert "distinct layers of the stage (4 to 7)" in errors["outside"]
        assert "unknown checkpoint mode 'auto' for a stage" in errors["auto"]
        assert "zbv splits each backward" in errors["zbv"]
        assert all("\n" not in message for message in errors.values())


def test_the_rank_benchmark_runs_a_units_plan_as_planned() -> None:
    """``autopipe bench --ranks`` hands each plan to the runner: a stage re-computing its
    units keeps only their inputs between forward and backward."""
    from autopipe.distributed.rank_bench import time_splits_on_ranks
    from autopipe.planning import evaluate
    from profiler import profile_model

    layers, sample = bench_blocks()
    profile = profile_model(layers, sample, device="cpu", chunks=2, repeats=1, warmup=0)
    options: dict[str, Any] = {"chunks": 2, "schedule": "gpipe", "checkpoint": "never"}
    kept = evaluate(profile, [4, 4], strategy="given", optimizer="sgd", **options)
    units = copy.deepcopy(kept)
    units.stages[0].checkpoint, units.stages[0].recompute_units = "units", [0, 1, 2, 3]
    plans = {"kept": kept, "units": units}
    result = time_splits_on_ranks(bench_blocks, plans, ranks=2, steps=1)
    assert all(t > 0 for measured in result.values() for t in measured.times)
    saved = {label: measured.saved_peak for label, measured in result.items()}
    # Each block keeps its input (16 x 8 float64 per step) instead of 16 x (8 + 32).
    assert saved["units"][0] == 4 * 16 * 8 * 8
    assert saved["kept"][0] == 4 * 16 * (8 + 32) * 8
    assert saved["units"][1] == saved["kept"][1]  # stage 1 keeps everything in both
