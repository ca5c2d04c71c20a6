"""Device descriptions for the planner."""

from __future__ import annotations

import pytest

from autopipe import DeviceSpec, make_devices


def test_count_and_memory_list():
    devices = make_devices(3, memory=["1GiB", None, 100])
    assert [d.memory for d in devices] == [2**30, None, 100]
    assert all(d.name == "cpu" for d in devices)


def test_names_and_shared_settings():
    devices = make_devices(["cuda:0", DeviceSpec("cuda:1", speed=2.0)], memory="1KB", bandwidth=5)
    assert [d.name for d in devices] == ["cuda:0", "cuda:1"]
    assert [d.speed for d in devices] == [1.0, 2.0]
    assert all(d.memory == 1000 and d.bandwidth == 5 for d in devices)
    assert all(d.latency == 0.0 for d in devices)


def test_latency_fills_in_devices_without_one():
    devices = make_devices([DeviceSpec(latency=2.0), "cpu"], latency=1e-4)
    assert [d.latency for d in devices] == [2.0, 1e-4]
    assert DeviceSpec.from_dict(devices[1].to_dict()) == devices[1]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: make_devices(0), "at least one stage"),
        (lambda: make_devices(2, memory=[1, 2, 3]), "memory has 3 entries"),
        (lambda: DeviceSpec(speed=0), "speed must be > 0"),
        (lambda: DeviceSpec(latency=-1.0), "latency must be >= 0"),
        (lambda: make_devices(2, memory="plenty"), "cannot parse memory size"),
    ],
)
def test_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
