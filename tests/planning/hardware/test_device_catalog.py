"""Tests of the device catalog (autopipe.planning.hardware.device_catalog)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from autopipe.planning import CatalogDevice, find_device, load_catalog
from autopipe.planning.hardware.catalog_entries import FIGURES
from autopipe.planning.hardware.device_catalog import (
    DTYPES,
    Link,
    catalog_devices,
    measured_device,
)

GOOD = """
[mygpu]
name = "My GPU"
aliases = ["My-GPU-X"]
memory = 24e9
memory_bandwidth = 1e12
intra_node = { bandwidth = 100e9, latency = 2e-6 }
inter_node = { bandwidth = 10e9, latency = 20e-6 }

[mygpu.peak_flops]
float32 = 50e12
bfloat16 = 200e12
"""

# What each edit of GOOD breaks, and what its error must say.
BAD = {
    "missing": (("memory = 24e9\n", ""), "lacks field 'memory'"),
    "unknown": (("memory = 24e9\n", "memory = 24e9\nmemroy_speed = 1\n"), "'memroy_speed'"),
    "negative": (
        ("memory = 24e9", "memory = -24e9"),
        "memory is -24000000000.0; it must be a finite number > 0",
    ),
    "infinite": (("memory_bandwidth = 1e12", "memory_bandwidth = inf"), "memory_bandwidth is inf"),
    "nan peak": (("float32 = 50e12", "float32 = nan"), "peak_flops.float32 is nan"),
    "zero": (("float32 = 50e12", "float32 = 0"), "peak_flops.float32 is 0"),
    "dtype": (("bfloat16 = 200e12", "int8 = 400e12"), "unknown field 'int8'"),
    "string": (("memory = 24e9", 'memory = "24GB"'), "memory is '24GB'; it must be a number"),
    "link field": (("latency = 2e-6 }", "latency = 2e-6, lag = 1 }"), "intra_node has unknown"),
    "link missing": (("{ bandwidth = 10e9, latency = 20e-6 }", "{ bandwidth = 10e9 }"), "latency"),
    "bool": (("memory = 24e9", "memory = true"), "memory is True"),
}


def write(tmp_path: Path, text: str, name: str = "mine.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_bundled_catalog_loads_the_devices_the_planner_knows() -> None:
    devices = load_catalog()
    assert {"h100", "h200", "a100-40gb", "a100-80gb", "l40s", "mi300x"} <= set(devices)
    h100 = devices["h100"]
    assert isinstance(h100, CatalogDevice)
    assert h100.peak("bfloat16") == 989.4e12 and h100.peak("tf32") == 494.7e12
    assert h100.peak("float32") == 66.9e12 and h100.memory == 80_000_000_000
    assert h100.memory_bandwidth == 3.35e12 and h100.intra_node.bandwidth == 450e9
    # Dense figures: bfloat16 runs at twice tf32 and half float8 on Hopper.
    assert h100.peak("float8") == pytest.approx(2 * h100.peak("bfloat16"), rel=1e-3)
    assert devices["a100-80gb"].memory_bandwidth > devices["a100-40gb"].memory_bandwidth
    assert "float8" not in devices["a100-40gb"].peak_flops
    # float64: the FP64 tensor-core figures, the L40S's plain FP64 (it has no such cores).
    float64 = {key: device.peak("float64") for key, device in devices.items()}
    assert float64 == {
        "h100": 67e12,
        "h200": 67e12,
        "h800": 1e12,
        "a100-40gb": 19.5e12,
        "a100-80gb": 19.5e12,
        "l40s": 1.431e12,
        "mi300x": 163.4e12,
    }


def test_every_bundled_figure_has_a_source() -> None:
    for key, device in load_catalog().items():
        assert device.sources, key
        given = {figure for source in device.sources for figure in source.figures}
        for source in device.sources:
            assert source.url.startswith("https://") and source.document
            assert set(source.figures) <= set(FIGURES)
        for figure in ("memory", "memory_bandwidth", "intra_node.bandwidth"):
            assert figure in given, (key, figure)
        assert "inter_node.bandwidth" in given, key
        for dtype in device.peak_flops:
            assert "peak_flops" in given or f"peak_flops.{dtype}" in given, (key, dtype)
        figures = [device.memory, device.memory_bandwidth, *device.peak_flops.values()]
        assert all(math.isfinite(x) and x > 0 for x in figures)
        assert set(device.peak_flops) <= set(DTYPES)


def test_names_are_case_insensitive_and_aliases_find_the_device() -> None:
    assert find_device("H100").key == "h100"
    assert find_device("h100-SXM").key == "h100"
    assert find_device("NVIDIA H100 80GB HBM3").key == "h100"  # torch's name for it
    assert find_device("AMD Instinct MI300X").key == "mi300x"


def test_an_unknown_name_lists_the_known_keys() -> None:
    with pytest.raises(ValueError, match="unknown device 'h20'; known: a100-40gb, .*mi300x"):
        find_device("h20")


def test_the_h800_is_an_h100_with_deepseeks_links() -> None:
    h800, h100 = find_device("NVIDIA H800"), find_device("h100")
    assert h800.key == "h800" and h800.memory == h100.memory
    assert h800.memory_bandwidth == h100.memory_bandwidth
    dense = ("float32", "tf32", "bfloat16", "float16", "float8")
    assert {d: h800.peak(d) for d in dense} == {d: h100.peak(d) for d in dense}
    # NVLink 400 GB/s both ways together; 8 x 400 Gb/s InfiniBand per node of 8 GPUs.
    assert h800.intra_node.bandwidth == 200e9
    assert h800.inter_node.bandwidth == 8 * 400e9 / 8 / 8
    assert any("DeepSeek-V3" in source.document for source in h800.sources)


def test_a_user_file_adds_a_device(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    devices = load_catalog([path])
    assert "h100" in devices and devices["mygpu"].peak("bfloat16") == 200e12
    assert find_device("my-gpu-x", [path]).name == "My GPU"
    assert devices["mygpu"].memory == 24_000_000_000 and devices["mygpu"].sources == ()
    with pytest.raises(ValueError, match=r"mygpu \(My GPU\) has no float16 peak"):
        devices["mygpu"].peak("float16")


def test_a_user_file_replaces_a_bundled_device_by_key(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("[mygpu", "[H100").replace("My-GPU-X", "h100-lab"))
    device = find_device("h100", [path])
    assert device.name == "My GPU" and device.memory_bandwidth == 1e12
    assert find_device("h100-lab", [path]) == device
    with pytest.raises(ValueError, match="unknown device 'h100-sxm'"):  # its aliases went too
        find_device("h100-sxm", [path])


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_entry_is_refused_in_one_line_naming_file_device_and_field(
    tmp_path: Path, case: str
) -> None:
    (old, new), message = BAD[case]
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ValueError) as info:
        load_catalog([path])
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{path}: device 'mygpu'") and message in text, text


def test_a_file_that_is_not_toml_or_missing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not valid TOML"):
        load_catalog([write(tmp_path, "[mygpu\nname = 1")])
    with pytest.raises(ValueError, match="cannot read the catalog file"):
        load_catalog([tmp_path / "absent.toml"])


def test_a_name_two_devices_claim_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("My-GPU-X", "h100-sxm"))
    with pytest.raises(ValueError, match="'mygpu' is also called 'h100-sxm'.*'h100'"):
        load_catalog([path])


def test_a_source_must_name_known_figures(tmp_path: Path) -> None:
    source = '\n[[mygpu.sources]]\ndocument = "d"\nurl = "https://x"\nfigures = ["speed"]\n'
    with pytest.raises(ValueError, match=r"device 'mygpu': sources\[0\].figures names 'speed'"):
        load_catalog([write(tmp_path, GOOD + source)])


def test_devices_on_one_node_share_the_intra_node_link() -> None:
    h100 = find_device("h100")
    specs = catalog_devices(h100, 4)
    assert [s.name for s in specs] == ["h100:0", "h100:1", "h100:2", "h100:3"]
    assert all(s.bandwidth == 450e9 and s.latency == 5e-6 for s in specs)
    assert all(s.memory == 80_000_000_000 for s in specs)


def test_node_boundaries_take_the_inter_node_link() -> None:
    h100 = find_device("h100")
    specs = catalog_devices(h100, 6, per_node=2, memory="70GiB")
    intra, inter = h100.intra_node.bandwidth, h100.inter_node.bandwidth
    # Device k's link goes to k+1; the last one's wraps to device 0, on another node.
    assert [s.bandwidth for s in specs] == [intra, inter, intra, inter, intra, inter]
    assert [s.latency for s in specs][:2] == [h100.intra_node.latency, h100.inter_node.latency]
    assert all(s.memory == 70 * 2**30 for s in specs)
    # Three devices on nodes of four: all on the first node.
    assert all(s.bandwidth == intra for s in catalog_devices(h100, 3, per_node=4))


@pytest.mark.parametrize("count, per_node", [(0, None), (2, 0), (True, None), (2, 1.5)])
def test_bad_counts_are_refused(count: int, per_node: int | None) -> None:
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        catalog_devices(find_device("h100"), count, per_node)


def test_a_device_from_measured_figures() -> None:
    figures = {
        "device": "cpu",
        "name": "Test CPU",
        "peak_flops": {"float32": 1e11, "bfloat16": 4e11},
        "memory_bandwidth": 2e10,
        "memory": 32e9,
    }
    device = measured_device(figures)
    assert device.key == "host" and device.name == "Test CPU"
    assert device.peak("bfloat16") == 4e11 and device.memory == 32_000_000_000
    assert device.intra_node.bandwidth == 1e10  # a copy reads and writes each byte
    own = measured_device(figures, key="Box", inter_node=Link(1e9, 1e-4))
    assert own.key == "box" and own.inter_node == Link(1e9, 1e-4)
    with pytest.raises(ValueError, match="memory_bandwidth is -1.0"):
        measured_device({**figures, "memory_bandwidth": -1.0})
    with pytest.raises(ValueError, match="lacks field 'memory'"):
        measured_device({k: v for k, v in figures.items() if k != "memory"})


def test_target_h800_resolves_on_the_command_line() -> None:
    from autopipe.cli.parser import build_parser
    from autopipe.cli.target import check_target_options

    args = build_parser().parse_args(["plan", "examples/mlp.py", "--target", "H800"])
    found = check_target_options(args)
    assert found is not None and found.key == "h800"
    assert found.name == "NVIDIA H800 SXM5 80GB"
