"""One device's figures of a stage's tensor × context group, against hand counts.

The blocks of :mod:`tests.support.mesh_profiles` at one sample: forward 8 s (64 FLOPs, 48
of them sharded), backward 16 s, 1024 saved bytes (512 sharded, 256 replicated that
sequence parallelism divides), 4096 parameter bytes (3072 sharded), 256 bytes
all-reduced forward and 512 backward over two collectives, 128 key/value bytes.
Links of 64 bytes/s and 0.5 s per message keep every figure exact in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.planning import estimate_profile
from autopipe.planning.hardware.device_catalog import measured_device
from autopipe.planning.hardware.estimates import Efficiency
from autopipe.planning.mesh.degree_figures import GroupLinks, mesh_lines
from autopipe.planning.mesh.mesh_links import GroupLink
from autopipe.planning.mesh.shard_table import ShardTable
from autopipe.planning.model.layer_costs import LayerCosts, ProfileLines
from autopipe.planning.model.mesh import Mesh
from profiler import Profile
from tests.support.mesh_profiles import block_profile, roofline_record

LINK = GroupLink(64.0, 0.5)
LINKS = GroupLinks(LINK, LINK, LINK)


def _costs(profile: Profile, mesh: Mesh, replicas: int = 1, size: int = 1) -> LayerCosts:
    lines = ProfileLines.from_profile(profile)
    found = mesh_lines(lines, ShardTable.from_profile(profile), mesh, LINKS, replicas)
    return found.at(size)


def _each(values: np.ndarray, expected: float) -> None:
    assert values.tolist() == [expected] * len(values)


def test_tensor_parallel_two_divides_the_sharded_share_and_adds_the_all_reduces() -> None:
    costs = _costs(block_profile(), Mesh(tensor=2))
    # 8 s · (16/64 replicated + 48/64 / 2) + (2·1/2 · 256 / 64 + 2 · 0.5)
    _each(costs.forward, 5.0 + 5.0)
    # 16 s · 0.625 + (512 / 64 + 1)
    _each(costs.backward, 10.0 + 9.0)
    _each(costs.saved, 512 + 256)
    _each(costs.params, 1024 + 1536)
    _each(costs.output, 256)  # the boundary is whole without sequence parallelism


def test_tensor_parallel_four() -> None:
    costs = _costs(block_profile(), Mesh(tensor=4))
    # 8 s · (0.25 + 0.1875) + (2·3/4 · 256 / 64 + 1)
    _each(costs.forward, 3.5 + 7.0)
    _each(costs.backward, 7.0 + 13.0)
    _each(costs.saved, 512 + 128)
    _each(costs.params, 1024 + 768)


def test_sequence_parallelism_divides_the_replicated_parts_too() -> None:
    costs = _costs(block_profile(), Mesh(tensor=2, sequence_parallel=True))
    _each(costs.forward, 8.0 * (0.25 / 2 + 0.375) + 5.0)  # same collective time
    _each(costs.saved, 256 + 128 + 256)
    _each(costs.output, 128)


def test_context_parallel_two_divides_tokens_and_exposes_the_ring_beyond_attention() -> None:
    costs = _costs(block_profile(), Mesh(context=2))
    # ring: 1/2 · 128 / 64 + 1 · 0.5 = 1.5 s; attention 16/64 of 4 s = 1 s.
    _each(costs.forward, 4.0 + 0.5)
    # backward ring twice: 3 s; attention 32/128 of 8 s = 2 s.
    _each(costs.backward, 8.0 + 1.0)
    _each(costs.saved, 512)
    _each(costs.params, 4096)  # replicated over the context group
    _each(costs.output, 128)
    assert costs.input == 32


def test_grouped_keys_and_values_fewer_than_t_are_replicated() -> None:
    # 2 key/value heads over t = 4: each device holds one whole head (half the bytes), not
    # a quarter. Compute 8 · 0.4375 / 2 = 1.75 s, all-reduces 2·3/4 · 128 / 64 + 1 = 4 s,
    # attention 16/64 of 1.75 s = 0.4375 s.
    grouped = _costs(block_profile(kv_heads=2), Mesh(tensor=4, context=2))
    plain = _costs(block_profile(kv_heads=8), Mesh(tensor=4, context=2))
    # ring 1/2 · 128/2 / 64 + 0.5 = 1 s, and 1/2 · 128/4 / 64 + 0.5 = 0.75 s.
    _each(grouped.forward, 1.75 + 4.0 + (1.0 - 0.4375))
    _each(plain.forward, 1.75 + 4.0 + (0.75 - 0.4375))


def test_estimated_profiles_rerun_the_roofline_on_the_divided_counts() -> None:
    profile = block_profile(estimate=roofline_record(peak=16.0, bandwidth=4.0))
    costs = _costs(profile, Mesh(tensor=2))
    # FLOPs 16 + 48/2 = 40 → 2.5 s; traffic 16 + 16/2 = 24 → 6 s: memory-bound, 6 s.
    _each(costs.forward, 6.0 + 5.0)
    # backward: 128 → 32 + 48 = 80 FLOPs (5 s), 64 → 32 + 16 = 48 bytes (12 s).
    _each(costs.backward, 12.0 + 9.0)


def test_figures_scale_with_the_micro_batch() -> None:
    one = _costs(block_profile(), Mesh(tensor=2, context=2), size=1)
    two = _costs(block_profile(), Mesh(tensor=2, context=2), size=2)
    assert two.saved.tolist() == (2 * one.saved).tolist()
    assert two.params.tolist() == one.params.tolist()


def test_zero_two_exposes_each_reduce_scatter_beyond_the_next_backward() -> None:
    costs = _costs(block_profile(), Mesh(zero=2), replicas=2)
    # The layers keep their compute; the exchanges are the stage's, by its span. One
    # unit's reduce-scatter: 1/2 · 4096 / 64 + 0.5 = 32.5 s against a 16 s backward.
    _each(costs.backward, 16.0)
    _each(costs.forward, 8.0)
    _each(costs.peak, 0.0)
    assert costs.exposure is not None
    fwd, bwd = costs.exposure.exposed(np.array([0, 1]), np.array([4, 3]))
    assert not fwd.any() and bwd.tolist() == [32.5 + 3 * 16.5, 32.5 + 16.5]


def test_zero_three_gathers_each_unit_and_holds_it_in_flight() -> None:
    costs = _costs(block_profile(), Mesh(zero=3), replicas=2)
    _each(costs.forward, 8.0)
    _each(costs.backward, 16.0)
    assert costs.exposure is not None
    fwd, bwd = costs.exposure.exposed(np.array(0), np.array(4))
    assert float(fwd) == 32.5 + 3 * 24.5  # the first gather, then each beyond a forward
    assert float(bwd) == 2 * 32.5 + 2 * 16.5 + 2 * 49.0
    _each(costs.peak, 2 * 4096 + 4096)
    assert _costs(block_profile(), Mesh(zero=1), replicas=2).exposure is None


def test_a_layer_without_shard_counts_is_refused_in_one_line() -> None:
    profile = block_profile(shards=False)
    with pytest.raises(
        ValueError, match=r"layer 0 \(Block 'blocks.0'\) has no shard counts.*--tp-plan"
    ):
        _costs(profile, Mesh(tensor=2))
    assert _costs(profile, Mesh()).forward.tolist() == [8.0] * 4  # t = c = 1 needs none


def test_heads_that_t_does_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="has 6 attention heads, which tensor parallelism 4"):
        _costs(block_profile(heads=6, kv_heads=6), Mesh(tensor=4))
    with pytest.raises(ValueError, match="3 key/value heads"):
        _costs(block_profile(heads=12, kv_heads=3), Mesh(tensor=4))


def _fp8_block_profile() -> Profile:
    box = measured_device(
        {"peak_flops": {"float8": 4.0, "bfloat16": 2.0}, "memory_bandwidth": 16.0, "memory": 1e9},
        key="fp8-box",
    )
    return estimate_profile(
        block_profile(), box, efficiency=Efficiency(1.0, 1.0, 0.0), dtype="float8"
    )


def test_float8_estimates_price_the_divided_attention_at_the_bfloat16_peak() -> None:
    costs = _costs(_fp8_block_profile(), Mesh(tensor=2))
    # FLOPs 16 + 48/2 = 40, of which attention 16/2 = 8: (40 − 8)/4 + 8/2 = 12 s, against
    # (16 + 16/2)/16 = 1.5 s of traffic; plus the 5 s all-reduce.
    _each(costs.forward, 12.0 + 5.0)
    # backward: 32 + 96/2 = 80 FLOPs, attention 32/2 = 16: 64/4 + 16/2 = 24 s; plus 9 s.
    _each(costs.backward, 24.0 + 9.0)
    # input gradient: 16 + 48/2 = 40 FLOPs, attention 16: 24/4 + 16/2 = 14 s; plus 9 s.
    assert costs.backward_input is not None
    _each(costs.backward_input, 14.0 + 9.0)


def test_a_record_without_the_attention_peak_prices_all_flops_at_its_peak() -> None:
    profile = _fp8_block_profile()
    del profile.meta["estimate"]["attention_peak_flops"]
    costs = _costs(profile, Mesh(tensor=2))
    _each(costs.forward, 40.0 / 4 + 5.0)  # 10 s of FLOPs at the one peak
    _each(costs.backward, 80.0 / 4 + 9.0)
