"""A profile's counts as arrays, its roofline, and the meshes it refuses."""

from __future__ import annotations

from autopipe.planning.mesh.shard_table import ShardTable, roofline_of
from autopipe.planning.model.mesh import Mesh
from tests.support.mesh_profiles import block_profile, roofline_record


def test_counts_and_shards_are_layers_by_sizes() -> None:
    table = ShardTable.from_profile(block_profile(3))
    assert table.counts["flops"].tolist() == [[64.0, 128.0]] * 3
    assert table.shards["reduce_backward"].tolist() == [[512.0, 1024.0]] * 3
    assert table.sharded_params.tolist() == [3072.0] * 3
    assert table.attention_heads == 8


def test_the_roofline_is_read_from_the_estimate_only_when_it_records_its_rates() -> None:
    assert roofline_of(block_profile()) is None
    found = roofline_of(block_profile(estimate=roofline_record(peak=16.0, bandwidth=4.0)))
    assert found is not None and (found.peak_flops, found.memory_bandwidth) == (16.0, 4.0)
    assert found.attention_peak_flops is None  # all FLOPs at the one peak, as before
    fp8 = {**roofline_record(peak=16.0), "attention_peak_flops": 8.0}
    found = roofline_of(block_profile(estimate=fp8))
    assert found is not None and found.attention_peak_flops == 8.0
    older = roofline_record()
    del older["peak_flops"]
    assert roofline_of(block_profile(estimate=older)) is None


def test_the_degrees_the_heads_allow() -> None:
    table = ShardTable.from_profile(block_profile(heads=8, kv_heads=2))
    assert [t for t in (1, 2, 3, 4, 8, 16) if table.allowed_tensor(t)] == [1, 2, 4, 8]
    assert table.refusal(Mesh(context=4)) is None
