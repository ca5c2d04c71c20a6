"""Stage time and memory formulas of the cost model."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from autopipe.planning.model.cost_model import CostModel, CostOptions, RangeMax, optimizer_factor
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import LayerCosts, ProfileLines
from tests.support.planning_cases import random_profile


def costs(n=4, **overrides):
    base = {
        "names": [f"l{i}" for i in range(n)],
        "forward": np.arange(1.0, n + 1),  # 1, 2, 3, 4
        "backward": 2 * np.arange(1.0, n + 1),
        "saved": np.full(n, 100.0),
        "output": np.array([10.0, 20.0, 30.0, 40.0])[:n],
        "params": np.full(n, 1000.0),
        "buffers": np.full(n, 7.0),
        "peak": np.zeros(n),
        "input": 5.0,
    }
    base.update(overrides)
    return LayerCosts(**base)


OPTIONS = {f.name for f in fields(CostOptions)}


def model(devices=2, **kwargs):
    specs = [DeviceSpec() for _ in range(devices)] if isinstance(devices, int) else devices
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
    return CostModel(costs(), specs, **{"chunks": 4, **kwargs}, options=CostOptions(**options))


def at(value):
    return np.array(value)


def test_stage_time_without_checkpointing():
    m = model(checkpoint="never")
    # Layers [1, 3): forward 2 + 3, backward 4 + 6.
    assert m.stage_time(0, at(1), at(3)) == pytest.approx(15.0)


def test_recompute_adds_forward_for_checkpointed_micro_batches():
    assert model(checkpoint="always").stage_time(0, at(1), at(3)) == pytest.approx(20.0)
    # except_last: 3 of 4 micro-batches recompute.
    assert model(checkpoint="except_last").stage_time(0, at(1), at(3)) == pytest.approx(18.75)


def test_speed_and_bandwidth():
    devices = [DeviceSpec(speed=2.0, bandwidth=10.0), DeviceSpec(bandwidth=10.0)]
    m = model(devices, checkpoint="never")
    # Stage 0 of layers [0, 2): compute (1+2 + 2+4)/2, sends layer 1's output (20 B).
    assert m.stage_time(0, at(0), at(2)) == pytest.approx(4.5 + 2.0)
    # The last stage sends nothing.
    assert m.transfer_time(1, at(4)) == 0.0
    slow = model([DeviceSpec(bandwidth=10.0, latency=0.5), DeviceSpec(latency=0.5)])
    assert slow.transfer_time(0, at(2)) == pytest.approx(0.5 + 2.0)
    assert slow.transfer_time(0, at(4)) == 0.0
    assert not slow.sum_is_invariant()
    latency_only = model([DeviceSpec(latency=0.5), DeviceSpec(latency=0.5)])
    assert latency_only.transfer_time(0, np.array([1, 2, 4])) == pytest.approx([0.5, 0.5, 0.0])


def test_state_memory_counts_gradients_and_optimizer():
    m = model(optimizer=optimizer_factor("adam"))
    # Two layers: params × (1 + grad + 2 Adam states) + buffers.
    assert m.state_memory(at(0), at(2)) == pytest.approx(2 * (4 * 1000 + 7))
    sgd = model(optimizer=optimizer_factor("sgd"))
    assert sgd.state_memory(at(0), at(2)) == pytest.approx(2 * (2 * 1000 + 7))


def test_gpipe_never_keeps_all_micro_batches():
    m = model(checkpoint="never")
    assert m.activation_memory(0, at(0), at(2)) == pytest.approx(4 * 200)


def test_gpipe_checkpoint_keeps_inputs_plus_one_micro_batch():
    m = model(checkpoint="always")
    # Stage starting at layer 0 takes the model input (5 B); at layer 2, layer 1's output.
    assert m.activation_memory(0, at(0), at(2)) == pytest.approx(4 * 5 + 200)
    assert m.activation_memory(1, at(2), at(4)) == pytest.approx(4 * 20 + 200)
    last = model(checkpoint="except_last")
    assert last.activation_memory(1, at(2), at(4)) == pytest.approx(3 * 20 + 200)


def test_1f1b_in_flight_depends_on_stage():
    m = model(devices=4, schedule="1f1b", checkpoint="never", chunks=3)
    assert [m.in_flight(k) for k in range(4)] == [3, 3, 2, 1]
    assert m.activation_memory(2, at(2), at(3)) == pytest.approx(2 * 100)
    gpipe = model(devices=4, schedule="gpipe", chunks=3)
    assert [gpipe.in_flight(k) for k in range(4)] == [3, 3, 3, 3]


def test_transient_peak_is_the_largest_in_the_stage():
    m = CostModel(
        costs(peak=np.array([5.0, 50.0, 7.0, 9.0])), [DeviceSpec()], chunks=1, checkpoint="never"
    )
    s, e = np.array([0, 2, 2, 0]), np.array([4, 3, 4, 1])
    base = m.activation_memory(0, s, e) - np.array([400.0, 100.0, 200.0, 100.0])
    assert base.tolist() == [50.0, 7.0, 9.0, 5.0]


def test_sum_invariance():
    assert model().sum_is_invariant()
    assert not model([DeviceSpec(speed=2.0), DeviceSpec()]).sum_is_invariant()
    assert not model([DeviceSpec(bandwidth=1.0), DeviceSpec()]).sum_is_invariant()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"checkpoint": "sometimes"}, "unknown checkpoint mode"),
        ({"schedule": "zigzag"}, "unknown schedule"),
        ({"schedule": "zb"}, "zb splits the backward, so except_last .* has no clear meaning"),
        ({"chunks": 0}, "chunks must be >= 1"),
        ({"optimizer": float("nan")}, "optimizer state factor must be a finite number >= 0"),
        ({"optimizer": float("inf")}, "optimizer state factor must be a finite number >= 0"),
        ({"optimizer": "adam"}, "convert a name with optimizer_factor"),
        ({"overhead": float("inf")}, "overhead must be finite seconds >= 0, got inf"),
        ({"overhead": "1ms"}, "overhead must be finite seconds >= 0, got '1ms'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        model(**kwargs)


def test_optimizer_factor():
    assert optimizer_factor("Adam") == 2.0
    assert optimizer_factor(1.5) == 1.5
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_factor("lion2")
    for value in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            optimizer_factor(value)
    with pytest.raises(TypeError, match="optimizer must be a name such as 'adam'"):
        optimizer_factor(None)  # type: ignore[arg-type]


def test_auto_takes_the_fastest_mode_that_fits():
    # Stage [0, 2): never keeps 4 × 200 B of activations, except_last 3 × 5 + 200.
    state = 2 * (4 * 1000 + 7)
    cap = state + 500
    m = model([DeviceSpec(memory=cap), DeviceSpec(memory=cap)], checkpoint="auto")
    s, e = np.array([0, 0, 3]), np.array([1, 2, 4])
    time, memory, choice = m.stage_costs(0, s, e)
    # One layer: never fits (4 × 100 B); two: except_last; ...
    assert [m.modes[i] for i in choice[:2]] == ["never", "except_last"]
    never = model(checkpoint="never")
    last = model(checkpoint="except_last")
    assert time[0] == never.stage_time(0, s[:1], e[:1])[0]
    assert time[1] == last.stage_time(0, s[1:2], e[1:2])[0]
    assert memory[1] == pytest.approx(last.stage_memory(0, at(0), at(2)))
    assert m.stage_checkpoint(0, 0, 2) == "except_last"
    assert m.recompute_time(0, at(0), at(2)) == pytest.approx(0.75 * (1 + 2))


def test_auto_without_room_takes_the_least_memory():
    m = model([DeviceSpec(memory=1), DeviceSpec(memory=1)], checkpoint="auto")
    _, memory, choice = m.stage_costs(1, at(2), at(4))
    least = min(float(model(checkpoint=c).stage_memory(1, at(2), at(4))) for c in m.modes)
    assert float(memory) == pytest.approx(least)
    assert m.modes[int(choice)] != "never"


def test_auto_breaks_sum_invariance_only_with_memory_limits():
    assert model(checkpoint="auto").sum_is_invariant()
    capped = [DeviceSpec(memory=10**6), DeviceSpec(memory=10**6)]
    assert not model(capped, checkpoint="auto").sum_is_invariant()
    with pytest.raises(ValueError, match="pass the mode"):
        model(checkpoint="auto").checkpointed(0)


def test_overhead_is_added_per_stage_and_micro_batch():
    plain = model(checkpoint="never")
    slow = model(checkpoint="never", overhead=0.25)
    assert slow.stage_time(1, at(2), at(4)) == pytest.approx(
        plain.stage_time(1, at(2), at(4)) + 0.25
    )
    assert slow.compute_time(1, at(2), at(4)) == pytest.approx(
        plain.compute_time(1, at(2), at(4)) + 0.25
    )


def test_allreduce_is_a_ring_over_the_replicas():
    m = model(data_parallel=4, allreduce_bandwidth=100.0)
    # 2 · (4 − 1) / 4 · 2000 parameter bytes / 100 B/s.
    assert m.allreduce_time(at(0), at(2)) == pytest.approx(1.5 * 2000 / 100)
    assert model(data_parallel=4).allreduce_time(at(0), at(2)) == 0.0
    assert model(allreduce_bandwidth=100.0).allreduce_factor == 0.0
    with pytest.raises(ValueError, match="data_parallel must be >= 1"):
        model(data_parallel=0)


def test_range_max_matches_brute_force():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 16, 33):
        values = rng.random(n)
        table = RangeMax(values)
        s, e = np.triu_indices(n + 1, 1)
        expected = [values[a:b].max() for a, b in zip(s, e)]
        assert table.query(s, e).tolist() == expected


def test_profile_lines_predict_like_the_profile():
    profile = random_profile(np.random.default_rng(1), 6, peaks=True)
    lines = ProfileLines.from_profile(profile)
    for micro in (1, 3, 4, 7):
        costs = lines.at(micro)
        for i in range(6):
            assert costs.forward[i] == profile.predict(i, "forward", micro)
            assert costs.peak[i] == profile.predict(i, "peak", micro)
        assert costs.input == profile.predict(-1, "input", micro)


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last", "auto"])
def test_stage_parts_add_up_to_the_stage_time(checkpoint):
    from autopipe.planning.schedules.schedule_replay import RECOMPUTE_CODES

    cap = 2 * (4 * 1000 + 7) + 500  # makes auto choose per stage (see above)
    devices = [DeviceSpec(memory=cap, speed=2.0, bandwidth=5.0, latency=0.5), DeviceSpec()]
    m = model(devices, checkpoint=checkpoint, overhead=0.25)
    s, e = np.array([0, 0, 1, 3, 2]), np.array([1, 2, 4, 4, 2])  # the last holds no layer
    for k in range(2):
        forward, backward, transfer, codes, memory = m.stage_parts(k, s, e)[:5]
        time, expected_memory, choice = m.stage_costs(k, s, e)
        assert memory == pytest.approx(expected_memory)
        modes = [m.modes[i] for i in choice]
        fraction = np.array([m.fraction(mode) for mode in modes])
        assert forward * (1 + fraction) + backward + transfer == pytest.approx(time)
        assert transfer == pytest.approx(m.transfer_time(k, e))
        assert list(codes) == [RECOMPUTE_CODES[mode] for mode in modes]
        # Forward and backward keep the layers' proportion (1:2 here), overhead included.
        assert backward[:4] == pytest.approx(2 * forward[:4])
        assert forward[4] > 0 and backward[4] > 0  # only overhead: shared out anyway


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "auto"])
def test_one_stage_is_priced_once_as_every_stage_is(checkpoint):
    # A single stage's figures are kept for the next ask: the same as pricing it among
    # many, asked once or again, and read-only (every caller shares them).
    cap = 2 * (4 * 1000 + 7) + 500  # makes auto choose per stage
    devices = [DeviceSpec(memory=cap, speed=2.0, bandwidth=5.0, latency=0.5), DeviceSpec()]
    m = model(devices, checkpoint=checkpoint, overhead=0.25, schedule="1f1b")
    s, e = np.array([0, 0, 1, 3, 2, 0]), np.array([1, 2, 4, 4, 3, 4])
    for k in range(2):
        many = m.stage_costs(k, s, e)
        for i in range(len(s)):
            first = m.stage_costs(k, s[i], e[i])
            again = m.stage_costs(k, int(s[i]), int(e[i]))
            for part, other, whole in zip(first, again, many, strict=True):
                assert part == whole[i] and other == whole[i]
                if isinstance(part, np.ndarray):
                    assert not part.flags.writeable
        assert m.recompute_time(k, s[2], e[2]) == m.recompute_time(k, s, e)[2]


def test_weight_share_is_measured_when_the_profile_has_it():
    measured = costs(backward_input=np.array([1.0, 2.0, 6.0, 8.0]))  # backward 2, 4, 6, 8
    m = CostModel(measured, [DeviceSpec(), DeviceSpec()], 4, checkpoint="never", schedule="zb")
    # Weights' part: 1, 2, 0, 0 of 2, 4, 6, 8.
    assert m.weight_share(at(0), at(2)) == pytest.approx(3 / 6)
    assert m.weight_share(at(2), at(4)) == pytest.approx(0.0)
    guessed = model(checkpoint="never", schedule="zb")  # every layer has parameters: half
    assert guessed.weight_share(at(0), at(4)) == pytest.approx(0.5)
    no_params = costs(params=np.zeros(4))
    none = CostModel(no_params, [DeviceSpec(), DeviceSpec()], 4, checkpoint="never")
    assert none.weight_share(at(0), at(4)) == pytest.approx(0.0)


def test_virtual_stages_choose_what_to_keep_within_their_share_of_the_device() -> None:
    # Each of a rank's stages may fit the device alone while the rank's stages together do
    # not: each chooses what to keep within its share of the device, so that under a cap
    # where keeping everything fits no split, re-computing units does, as planned.
    from autopipe import PlanningError
    from autopipe.planning import plan
    from tests.support.planning_cases import linear_profile

    profile = linear_profile([1.0] * 8, saved=[100] * 8, output=[10] * 8, chunks=4, input_bytes=10)
    options = {"chunks": 4, "schedule": "1f1b", "optimizer": "sgd", "virtual_stages": 2}
    need = max(plan(profile, 4, checkpoint="never", **options).device_memory or [])
    checked = 0
    for percent in range(98, 40, -4):
        cap = need * percent / 100
        try:
            plan(profile, 4, checkpoint="never", memory=cap, **options)
            continue
        except PlanningError:
            pass
        found = plan(profile, 4, checkpoint="auto", memory=cap, **options)
        for stage in found.stages:  # a stage in mode units names what it re-computes
            assert (stage.checkpoint == "units") == bool(stage.recompute_units)
        assert max(found.device_memory or []) <= cap
        checked += "units" in found.stage_checkpoints
    assert checked


def test_only_dualpipev_keeps_the_all_to_alls_apart():
    import dataclasses

    talk = np.array([0.5, 0.25, 0.0, 1.0])
    layers = dataclasses.replace(costs(), alltoall_forward=talk, alltoall_backward=2 * talk)
    devices = [DeviceSpec(speed=2.0)] * 4
    for schedule in ("zbv", "dualpipev"):
        m = CostModel(layers, devices, 4, checkpoint="never", schedule=schedule)
        parts = m.stage_parts(1, np.array([0, 1]), np.array([2, 4]))
        if schedule == "zbv":  # charged whole, none kept apart
            assert not m.overlapped and not np.any(parts.comm_forward)
            continue
        # Per forward (0.5 + 0.25 or 0.25 + 1) / 2, the backward twice that: parts of both.
        assert parts.comm_forward == pytest.approx([0.375, 0.625])
        assert parts.comm_backward == pytest.approx([0.75, 1.25])
        assert np.all(parts.comm_forward <= parts.forward)
    plain = CostModel(costs(), devices, 4, checkpoint="never", schedule="dualpipev")
    assert not plain.overlapped
