"""The search space of ``search`` (autopipe.planning.configuration.search_space): the micro-batch
counts it tries and the bounds it prunes configurations by."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.planning.configuration.search_space import Config, Space, chunk_options
from autopipe.planning.planner import evaluate
from tests.support.planning_cases import random_profile


def test_chunk_options():
    assert chunk_options(10, 100) == [(1, 10), (2, 5), (3, 4), (4, 3), (5, 2), (10, 1)]
    assert chunk_options(10, 4) == [(1, 10), (2, 5), (3, 4), (4, 3)]
    for batch in range(1, 60):
        options = chunk_options(batch, batch)
        micros = [math.ceil(batch / m) for m in range(1, batch + 1)]
        assert [micro for _, micro in options] == sorted(set(micros), reverse=True)
        assert all(m == math.ceil(batch / micro) for m, micro in options)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.sampled_from([(2, 2, 4), (2, 3, 2), (3, 2, 3), (2, 2, 1), (4, 2, 8)]),
    replicas=st.sampled_from([1, 2]),
    bandwidth=st.sampled_from([None, 300.0]),
    overhead=st.sampled_from([0.0, 0.05]),
)
def test_virtual_stage_bound_is_below_every_split(seed, shape, replicas, bandwidth, overhead):
    # The search prunes interleaved configurations by this bound: it must never exceed
    # the replayed step of any split, or the search could miss the best one.
    k, v, m = shape
    rng = np.random.default_rng(seed)
    profile = random_profile(rng, k * v + 3)
    profile.meta["calibration"] = {"virtual_overhead_s": overhead}
    batch = m * 2 * replicas
    space = Space(
        profile, capacity=None, bandwidth=bandwidth, allreduce_bandwidth=500.0, optimizer="adam"
    )
    for schedule in ("gpipe", "1f1b"):
        config = Config(k, replicas, m, 2, "never", schedule, 2 * m, v)
        bound, possible = space.bound(config)
        assert possible
        for _ in range(5):
            cuts = sorted(rng.choice(np.arange(1, len(profile)), k * v - 1, replace=False))
            balance = np.diff([0, *cuts, len(profile)]).tolist()
            result = evaluate(
                profile,
                balance,
                chunks=m,
                checkpoint="never",
                schedule=schedule,
                virtual_stages=v,
                data_parallel=replicas,
                batch=batch,
                bandwidth=bandwidth,
                allreduce_bandwidth=500.0,
            )
            assert bound <= result.step_time * (1 + 1e-9)


def test_v_schedules_give_one_configuration_of_2k_stages() -> None:
    from autopipe.planning.configuration.search_space import Bounds, configurations

    found = configurations(Bounds(4, 10, 8, ["never"], ["zbv", "dualpipev"]))
    assert found and all(c.virtual == 2 and c.checkpoint == "never" for c in found)
    assert all(c.stages >= 2 and 2 * c.stages <= 10 for c in found)
    assert all(c.chunks >= 2 * c.stages for c in found if c.schedule == "dualpipev")


def test_v_schedules_weigh_re_computation_but_not_except_last() -> None:
    from autopipe.planning.configuration.search_space import Bounds, configurations

    modes = ["never", "except_last", "always", "auto"]
    found = configurations(Bounds(4, 10, 8, modes, ["zbv", "dualpipev"]))
    # ``auto`` weighs ``always`` per stage: listing both adds no configuration.
    assert {c.checkpoint for c in found} == {"never", "auto"}
    alone = configurations(Bounds(4, 10, 8, ["always"], ["zbv"]))
    assert alone and {c.checkpoint for c in alone} == {"always"}
    assert not configurations(Bounds(4, 10, 8, ["except_last"], ["zbv"]))


def test_the_looped_bubble_share_stays_below_the_replayed_step() -> None:
    # The virtual-stage bound counts BUBBLE_SHARE of the balanced bubble: random stage
    # times replayed under the looped schedules never come closer than that to the work.
    from autopipe.planning.configuration.search_space import BUBBLE_SHARE, LOOPED
    from autopipe.planning.schedules.schedule_replay import makespans

    rng = np.random.default_rng(7)
    least = math.inf
    for trial in range(600):
        k, v = int(rng.integers(2, 7)), int(rng.integers(2, 5))
        m, stages = int(k * rng.integers(1, 4)), k * v
        kind = trial % 4
        if kind == 0:
            forward = rng.lognormal(0.0, 1.5, stages)
        elif kind == 1:
            forward = rng.exponential(1.0, stages) * (rng.random(stages) < 0.5)
        elif kind == 2:
            forward = 1.0 + 0.1 * rng.random(stages)
        else:
            forward = np.ones(stages)
            forward[rng.integers(stages)], forward[rng.integers(stages)] = 0.0, 5.0
        backward = forward * rng.uniform(1.0, 3.0, stages)
        send = rng.exponential(0.1, stages) * (trial % 2)
        send[-1] = 0.0
        total = float((forward + backward + send).sum())
        bubble = (k - 1) * total / (k * v)
        for schedule in LOOPED:
            step = makespans(
                forward[None], backward[None], send[None],
                np.zeros((1, stages), dtype=np.int64), k, m, schedule,
            )[0]  # fmt: skip
            least = min(least, (step - m * total / k) / bubble)
    assert BUBBLE_SHARE < least < 1.0
