"""ZeRO-2/3's exchanges per unit: exposed beyond the neighbouring compute, in the cost
model's memory and step, and on the replayed schedule."""

from __future__ import annotations

import itertools

import numpy as np

from autopipe.planning.mesh.degree_figures import GroupLinks, mesh_lines
from autopipe.planning.mesh.mesh_links import GroupLink
from autopipe.planning.mesh.shard_table import ShardTable
from autopipe.planning.mesh.zero_exchange import StageExchanges, unit_exchange
from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.mesh import Mesh
from autopipe.planning.split.interleaved_balance import pipeline_time
from tests.support.mesh_profiles import block_profile

LINK = GroupLink(64.0, 0.5)


def test_a_unit_moves_its_share_of_the_others_parameters_in_a_ring() -> None:
    params = np.array([4096.0, 0.0])
    # S − 1 = 3 steps, each paying the link's latency.
    assert unit_exchange(params, 4, LINK).tolist() == [3 / 4 * 4096 / 64 + 3 * 0.5, 0.0]
    assert unit_exchange(params, 1, LINK).tolist() == [0.0, 0.0]


def test_compute_long_enough_hides_every_exchange_but_each_stage_s_ends() -> None:
    unit = np.full(4, 32.5)
    slow = np.full(4, 1000.0)
    zero3 = StageExchanges(3, unit, slow, slow)
    # The whole model as one stage: its first forward gather; its first backward gather
    # (of the last layer) and its last reduce-scatter (of the first).
    assert [float(x) for x in zero3.exposed(0, 4)] == [32.5, 65.0]
    # Every stage alike: the next stage's units run on another device, hiding nothing.
    assert [float(x) for x in zero3.exposed(2, 4)] == [32.5, 65.0]
    assert [float(x) for x in zero3.exposed(1, 2)] == [32.5, 65.0]
    zero2 = StageExchanges(2, unit, slow, slow)
    assert [float(x) for x in zero2.exposed(1, 3)] == [0.0, 32.5]  # its last reduce-scatter


def test_short_compute_exposes_what_outlasts_it_within_the_stage() -> None:
    # Units of 32.5 s beside passes of 8 s forward, 16 s backward.
    unit, forward, backward = np.full(5, 32.5), np.full(5, 8.0), np.full(5, 16.0)
    zero3 = StageExchanges(3, unit, forward, backward)
    s, e = np.array([0, 1, 1, 2]), np.array([5, 4, 2, 5])
    fwd, bwd = zero3.exposed(s, e)
    # Forward: the first gather, then each later unit's gather beyond the previous
    # forward (24.5 s each).
    assert fwd.tolist() == [32.5 + 4 * 24.5, 32.5 + 2 * 24.5, 32.5, 32.5 + 2 * 24.5]
    # Backward: two whole exchanges; the end windows carry one exchange (16.5 s beyond),
    # the inner ones two (49 s beyond); one layer has no window with anything in it.
    assert bwd.tolist() == [65 + 2 * 16.5 + 3 * 49, 65 + 2 * 16.5 + 49, 65, 65 + 2 * 16.5 + 49]
    # ZeRO-2: the last reduce-scatter whole, each other beyond the next layer's backward.
    zero2 = StageExchanges(2, unit, forward, backward)
    fwd, bwd = zero2.exposed(s, e)
    assert not fwd.any() and bwd.tolist() == [
        32.5 + 4 * 16.5,
        32.5 + 2 * 16.5,
        32.5,
        32.5 + 2 * 16.5,
    ]


def _model(zero: int, replicas: int = 2, chunks: int = 4) -> CostModel:
    profile = block_profile(4)
    lines = ProfileLines.from_profile(profile)
    mesh = Mesh(zero=zero)
    links = GroupLinks(LINK, LINK, LINK)
    costs = mesh_lines(lines, ShardTable.from_profile(profile), mesh, links, replicas).at(1)
    devices = [DeviceSpec(f"d{k}", None, 1.0) for k in range(2)]
    options = CostOptions(data_parallel=replicas, allreduce_bandwidth=64.0, mesh=mesh)
    return CostModel(costs, devices, chunks, "never", "gpipe", 2.0, options)


def test_each_stage_holds_its_share_of_the_state() -> None:
    s, e = np.array(0), np.array(2)
    # Adam (2 state bytes per parameter byte) over S = 2: 4, 3, 1 + 3/2, 4/2 per byte.
    for zero, factor in ((0, 4.0), (1, 3.0), (2, 2.5), (3, 2.0)):
        assert float(_model(zero).state_memory(s, e)) == factor * 2 * 4096
    # ZeRO-3 holds a gathered unit in flight: its parameters and gradients and the next.
    gathered = float(_model(3).stage_memory(0, s, e)) - float(_model(2).stage_memory(0, s, e))
    assert gathered == (2.0 - 2.5) * 2 * 4096 + 3 * 4096


def test_the_exchange_after_the_drain_shrinks_with_the_stage() -> None:
    s, e = np.array(0), np.array(2)
    # all-reduce 2 · 1/2 · 8192 / 64 = 128 s; ZeRO-2 only gathers (64 s); ZeRO-3 nothing.
    assert [float(_model(z).allreduce_time(s, e)) for z in range(4)] == [128.0, 128.0, 64.0, 0.0]


def test_the_replayed_schedule_counts_each_stage_s_exchanges() -> None:
    model = _model(3)
    # Units of 32.5 s (1/2 · 4096 / 64 + 0.5), forwards of 8 s, backwards of 16 s. Each
    # stage of [2, 2]: forwards 16 + 32.5 (its first gather) + 24.5 (its second beyond
    # the first forward), backwards 32 + 2 · 32.5 (first gather, last reduce-scatter) +
    # 2 · 16.5 (one exchange beyond each window): 73 + 130 per micro-batch. Nothing of the
    # other stage's units hides anything. GPipe, M = 4, balanced: Σc + (M − 1) · max c.
    stage = 73 + 130
    assert pipeline_time(model, [2, 2]) == 2 * stage + 3 * stage
    # The split decides what is exposed: [1, 3] exposes more on its three-layer stage's
    # inner window (49 s) and all of a one-layer stage's exchanges.
    one, three = 8 + 32.5 + 16 + 65, 24 + 32.5 + 2 * 24.5 + 48 + 65 + 2 * 16.5 + 49
    assert pipeline_time(model, [1, 3]) == one + three + 3 * max(one, three)
    # On one stage the exchanges at the cut are what a single stage of the whole model
    # hides: the exposure is the stages', not one sum over the layers.
    whole = float(model.stage_time(0, np.array(0), np.array(4)))
    parts = sum(float(model.stage_time(k, np.array(2 * k), np.array(2 * k + 2))) for k in (0, 1))
    assert parts > whole


def test_cutting_the_model_never_exposes_less_than_the_whole() -> None:
    # The search bounds a configuration's exposed exchanges by the whole model's: every
    # split into stages must expose at least as much, forward and backward.
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(2, 12))
        unit, forward, backward = (rng.exponential(1.0, n) for _ in range(3))
        for zero in (2, 3):
            exchanges = StageExchanges(zero, unit, forward, backward)
            whole = [float(x) for x in exchanges.exposed(0, n)]
            cuts = sorted(rng.choice(np.arange(1, n), int(rng.integers(1, n)), replace=False))
            bounds = [0, *cuts, n]
            parts = [exchanges.exposed(s, e) for s, e in itertools.pairwise(bounds)]
            assert sum(float(f) for f, _ in parts) >= whole[0] * (1 - 1e-12)
            assert sum(float(b) for _, b in parts) >= whole[1] * (1 - 1e-12)
