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


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (2.5, "devices must be a stage count or a list of DeviceSpec or device names"),
        (None, "got None"),
        (True, "got True"),
        # A string is a sequence: it used to give one device per character.
        ("cuda:0", "such as \\['cuda:0', 'cuda:1'\\], got 'cuda:0'"),
        ([0, 1], "a device must be a DeviceSpec or a device name, got 0"),
    ],
)
def test_device_list_of_the_wrong_kind(devices, message):
    with pytest.raises(TypeError, match=message):
        make_devices(devices)


def test_sizes_and_rates_parse_wherever_a_device_takes_them():
    assert DeviceSpec(memory="1KiB") == DeviceSpec(memory=1024)
    assert DeviceSpec(bandwidth="10GB/s") == DeviceSpec(bandwidth=1e10)
    assert make_devices(2, bandwidth="1GB")[1].bandwidth == 1e9
    assert DeviceSpec(speed=2).speed == 2.0 and isinstance(DeviceSpec(speed=2).speed, float)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: DeviceSpec(memory=float("nan")), ValueError, "device cpu: memory nan is not"),
        (lambda: DeviceSpec(memory="1e999"), ValueError, "memory '1e999' is not a finite size"),
        (lambda: DeviceSpec(bandwidth=float("inf")), ValueError, "bandwidth inf is not a finite"),
        (lambda: DeviceSpec(bandwidth="fast"), ValueError, "cannot parse bandwidth 'fast'"),
        (lambda: DeviceSpec(speed=float("inf")), ValueError, "speed must be > 0, got inf"),
        (lambda: DeviceSpec(speed="fast"), TypeError, "device cpu: speed must be a number"),
        (lambda: DeviceSpec(latency=float("inf")), ValueError, "latency must be >= 0, got inf"),
        (lambda: DeviceSpec(latency="1ms"), TypeError, "latency must be a number"),
        (lambda: DeviceSpec(name=3), TypeError, "a device name must be a string"),
        (lambda: make_devices(2, speed="x"), TypeError, "speed must be a number, got 'x'"),
        (lambda: make_devices(2, bandwidth=float("nan")), ValueError, "bandwidth nan"),
        (lambda: make_devices(2, memory="1e999"), ValueError, "memory '1e999' is not a finite"),
    ],
)
def test_values_no_device_has(call, error, message):
    with pytest.raises(error, match=message):
        call()
