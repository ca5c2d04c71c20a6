"""Per-unit re-computation (autopipe.planning.model.unit_recompute) against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopipe.planning import plan
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import LayerCosts
from autopipe.planning.model.unit_recompute import Front, Holding, UnitRecompute
from autopipe.planning.split.exact import solve_split
from tests.support.planning_cases import linear_profile, splits


def _layers(rng: np.random.Generator, n: int) -> LayerCosts:
    saved = rng.integers(10, 200, n).astype(float)
    return LayerCosts(
        names=[f"l{i}" for i in range(n)],
        forward=rng.uniform(0.5, 3.0, n).round(3),
        backward=rng.uniform(1.0, 6.0, n).round(3),
        saved=saved,
        output=rng.integers(5, 120, n).astype(float),
        params=rng.integers(0, 50, n).astype(float),
        buffers=np.zeros(n),
        peak=np.zeros(n),
        input=float(rng.integers(5, 120)),
        shared=np.concatenate([[0.0], np.minimum(rng.integers(0, 30, n - 1), saved[1:])]),
    )


def test_the_front_gives_the_cheapest_subset_freeing_enough() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        benefits = rng.integers(-20, 60, 7).astype(float)
        costs = rng.uniform(0.0, 5.0, 7)
        front = Front.empty()
        for i, (b, c) in enumerate(zip(benefits, costs, strict=True)):
            front = front.add(float(b), float(c), 1 << i)
        for need in rng.uniform(-5, 200, 12):
            subsets = [r for size in range(8) for r in itertools.combinations(range(7), size)]
            fitting = [sum(costs[list(r)]) for r in subsets if sum(benefits[list(r)]) >= need]
            j = front.cheapest(float(need))
            if not fitting:
                assert j == -1
                continue
            assert front.seconds[j] == pytest.approx(min(fitting))
            chosen = [i for i in range(7) if front.masks[j] >> i & 1]
            assert sum(benefits[chosen]) >= need
            assert sum(costs[chosen]) == pytest.approx(front.seconds[j])


def _stage_options(
    layers: LayerCosts, s: int, e: int, n: int, chunks: int, cap: float
) -> list[tuple[float, float]]:
    """(seconds, bytes) of every way stage [s, e) may run under ``auto``, written out
    from the model's definitions (SGD: parameters and their gradients)."""
    state = 2.0 * layers.params[s:e].sum()
    inputs = np.concatenate([[layers.input], layers.output[:-1]])
    kept = [layers.saved[u] - (layers.shared[u] if u > s else 0.0) for u in range(s, e)]
    fwd, bwd = layers.forward[s:e].sum(), layers.backward[s:e].sum()
    ck = min(n, chunks - 1)
    options = [
        (fwd + bwd, state + n * sum(kept)),
        (
            fwd * (1 + (chunks - 1) / chunks) + bwd,
            state + ck * inputs[s] + max(n - ck, 1) * sum(kept),
        ),
    ]
    for size in range(1, e - s + 1):
        for chosen in itertools.combinations(range(e - s), size):
            held = sum(inputs[s + i] if i in chosen else kept[i] for i in range(e - s))
            extra = sum(layers.forward[s + i] for i in chosen)
            options.append((fwd + bwd + extra, state + n * held + layers.saved[s:e].max()))
    return options


@pytest.mark.parametrize("seed", range(12))
def test_auto_plans_the_best_split_and_units_of_every_choice(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_layers, stages, chunks = int(rng.integers(3, 7)), int(rng.integers(2, 4)), 4
    if stages > n_layers:
        stages = n_layers
    layers = _layers(rng, n_layers)
    total = 2.0 * layers.params.sum() + chunks * layers.saved.sum()
    cap = float(total * rng.uniform(0.25, 0.7) / stages * 1.5)
    model = CostModel(layers, [DeviceSpec(memory=cap)] * stages, chunks, "auto", "gpipe", 0.0)
    best = None
    for balance in splits(n_layers, stages):
        bounds = np.concatenate([[0], np.cumsum(balance)])
        times = []
        for k in range(stages):
            s, e = int(bounds[k]), int(bounds[k + 1])
            fitting = [t for t, m in _stage_options(layers, s, e, chunks, chunks, cap) if m <= cap]
            if not fitting:
                break
            times.append(min(fitting))
            # The model's own choice for this stage is as fast as the best that fits.
            assert float(model.stage_time(k, np.array(s), np.array(e))) == pytest.approx(
                min(fitting)
            )
        else:
            step = sum(times) + (chunks - 1) * max(times)
            best = step if best is None else min(best, step)
    found = solve_split(model)
    if best is None:
        assert found is None
        return
    assert found is not None
    assert found[0] == pytest.approx(best, rel=1e-9)


def test_a_plan_lists_the_units_it_recomputes_and_they_fit() -> None:
    # Four layers whose saved tensors dwarf their inputs: keeping everything needs
    # 4 micro-batches x 4 x 100 bytes; the cap leaves room for two of them.
    profile = linear_profile(
        [1.0, 2.0, 3.0, 4.0],
        saved=[100, 100, 100, 100],
        output=[10, 10, 10, 10],
        batch=8,
        chunks=4,
        input_bytes=10,
    )
    found = plan(profile, 1, chunks=4, checkpoint="auto", memory=1200)
    stage = found.stages[0]
    assert stage.checkpoint == "units"
    # Each re-computed unit frees 4 x 90 bytes; the cheapest two that fit are 0 and 1,
    # freeing 720 of the 1,600 + 100 (one unit's saved set, live again) needed.
    assert stage.recompute_units == [0, 1]
    assert stage.memory <= 1200
    assert stage.recompute == pytest.approx(1.0 + 2.0)
    again = type(found).from_dict(found.to_dict())
    assert again.stages[0].recompute_units == [0, 1]


def test_recompute_units_are_checked_on_load() -> None:
    profile = linear_profile([1.0, 2.0], saved=[100, 100], output=[10, 10], chunks=2)
    data = plan(profile, 1, chunks=2, checkpoint="auto", memory=2000).to_dict()
    data["stages"][0]["recompute_units"] = [5]
    with pytest.raises(ValueError, match="recompute_units"):
        type(plan(profile, 1)).from_dict(data)


def test_units_that_free_nothing_are_never_chosen() -> None:
    layers = LayerCosts(
        names=["a", "b"],
        forward=np.array([1.0, 1.0]),
        backward=np.array([2.0, 2.0]),
        saved=np.array([10.0, 100.0]),
        output=np.array([50.0, 5.0]),
        params=np.zeros(2),
        buffers=np.zeros(2),
        peak=np.zeros(2),
        input=40.0,
    )
    units = UnitRecompute(layers)
    # Unit a keeps 10 bytes but its input is 40: re-computing it would hold more.
    assert units.benefit(0, 0) < 0 and units.benefit(1, 0) == 50.0
    assert units.units(0, 2, Holding.whole(2), 150.0) == [1]


def test_bytes_the_backward_rebuilds_are_held_with_the_full_sets() -> None:
    """Under split backward ``y`` micro-batches hold their full set and what their input
    gradient re-built (re-computed norms' outputs); ``need`` frees just enough for it."""
    holding = Holding(4, ((3, 1), (1, 2)), transient=False)
    kept, freed, rebuilt = np.array([100.0]), np.array([60.0]), np.array([20.0])
    memory = holding.memory(kept, freed, np.zeros(1), rebuilt)
    # max(3·40 + 1·120, 1·40 + 2·120)
    assert memory.tolist() == [280.0]
    need = holding.need(kept, np.array([280.0]), np.zeros(1), rebuilt)
    assert holding.memory(kept, need, np.zeros(1), rebuilt).tolist() == [280.0]
    # Nothing freed: every micro-batch keeps all, and the most full sets their re-built bytes.
    assert holding.memory(kept, np.zeros(1), np.zeros(1), rebuilt).tolist() == [4 * 100 + 2 * 20]
