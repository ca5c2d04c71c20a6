"""Hand-made profiles of transformer-like blocks with shard counts, for the mesh tests.

Every figure is proportional to the batch size (measured at sizes 1 and 2) and a power
of two or a small multiple of one, so that the figures the mesh divides stay exact in
float64.
"""

from __future__ import annotations

from typing import Any

from profiler import ExpertCounts, LayerProfile, Profile, ShardCounts

# One block at one sample: what it counts, and what of it the tensor-parallel plan shards.
BLOCK: dict[str, float] = {
    "forward": 8.0,  # seconds (measured profiles)
    "backward": 16.0,
    "backward_input": 8.0,
    "flops": 64.0,
    "backward_flops": 128.0,
    "backward_input_flops": 64.0,
    "traffic": 32.0,
    "backward_traffic": 64.0,
    "saved": 1024,
    "output": 256,
    "param_bytes": 4096,
    # sharded parts
    "s_flops": 48.0,
    "s_backward_flops": 96.0,
    "s_backward_input_flops": 48.0,
    "s_traffic": 16.0,
    "s_backward_traffic": 32.0,
    "s_saved": 512,
    "s_param_bytes": 3072,
    "reduce_forward": 256,
    "reduce_backward": 512,
    "replicated_saved": 256,
    "attention_flops": 16.0,
    "attention_backward_flops": 32.0,
    "kv_bytes": 128,
}


def _at(value: float, size: int) -> float:
    return value * size


def block_layer(
    index: int, *, heads: int = 8, kv_heads: int = 8, shards: bool = True, **changes: float
) -> LayerProfile:
    """Block ``index`` with :data:`BLOCK`'s figures (``changes`` override some)."""
    b = {**BLOCK, **changes}
    sizes = (1, 2)

    def per(name: str) -> list[float]:
        return [_at(b[name], s) for s in sizes]

    def ints(name: str) -> list[int]:
        return [round(_at(b[name], s)) for s in sizes]

    counts = ShardCounts(
        flops=per("s_flops"),
        backward_flops=per("s_backward_flops"),
        backward_input_flops=per("s_backward_input_flops"),
        traffic=per("s_traffic"),
        backward_traffic=per("s_backward_traffic"),
        saved=ints("s_saved"),
        param_bytes=round(b["s_param_bytes"]),
        reduce_forward=ints("reduce_forward"),
        reduce_backward=ints("reduce_backward"),
        reductions=2,
        replicated_saved=ints("replicated_saved"),
        attention_flops=per("attention_flops"),
        attention_backward_flops=per("attention_backward_flops"),
        kv_bytes=ints("kv_bytes"),
        attention_calls=1,
        heads=heads,
        kv_heads=kv_heads,
    )
    return LayerProfile(
        name=f"blocks.{index}",
        kind="Block",
        forward=per("forward"),
        backward=per("backward"),
        backward_input=per("backward_input"),
        saved=ints("saved"),
        output=ints("output"),
        param_bytes=round(b["param_bytes"]),
        flops=per("flops"),
        backward_flops=per("backward_flops"),
        backward_input_flops=per("backward_input_flops"),
        traffic=per("traffic"),
        backward_traffic=per("backward_traffic"),
        shards=counts if shards else None,
    )


def block_profile(
    layers: int = 4, *, batch: int = 8, estimate: dict[str, Any] | None = None, **kw: Any
) -> Profile:
    """``layers`` blocks; ``estimate`` becomes ``meta["estimate"]`` (a roofline's record)."""
    meta: dict[str, Any] = {} if estimate is None else {"estimate": estimate}
    return Profile(
        layers=[block_layer(i, **kw) for i in range(layers)],
        batch_sizes=[1, 2],
        input=[64, 128],
        batch_size=batch,
        meta=meta,
    )


def roofline_record(peak: float = 16.0, bandwidth: float = 4.0) -> dict[str, Any]:
    """A ``meta["estimate"]`` whose roofline is exact: η = 1, no overhead."""
    return {
        "target": "toy",
        "name": "toy",
        "efficiency": {"compute": 1.0, "memory": 1.0, "overhead": 0.0},
        "fitted": False,
        "dtype": "float32",
        "counted_on": "meta",
        "peak_flops": peak,
        "memory_bandwidth": bandwidth,
    }


# One block's routed experts at one sample: half the block's parameters (2048 of 4096
# bytes, all of its dense rest sharded), FLOPs (32 of 64) and backward FLOPs, a quarter
# of its saved bytes, and 128 bytes of token copies dispatched per forward.
EXPERTS: dict[str, float] = {
    "param_bytes": 2048,
    "flops": 32.0,
    "backward_flops": 64.0,
    "backward_input_flops": 32.0,
    "saved": 256,
    "dispatch_bytes": 128,
}


def moe_layer(
    index: int,
    *,
    experts: int = 4,
    top_k: int = 2,
    skew: float = 1.0,
    groups: int = 1,
    top_groups: int = 1,
    **kw: Any,
) -> LayerProfile:
    """Block ``index`` of :func:`block_layer` with one mixture-of-experts block of
    :data:`EXPERTS`' routed experts (routed within ``top_groups`` of ``groups``)."""
    layer = block_layer(index, **kw)
    sizes = (1, 2)
    layer.experts = ExpertCounts(
        experts=experts,
        top_k=top_k,
        blocks=1,
        param_bytes=round(EXPERTS["param_bytes"]),
        flops=[EXPERTS["flops"] * s for s in sizes],
        backward_flops=[EXPERTS["backward_flops"] * s for s in sizes],
        backward_input_flops=[EXPERTS["backward_input_flops"] * s for s in sizes],
        saved=[round(EXPERTS["saved"]) * s for s in sizes],
        dispatch_bytes=[round(EXPERTS["dispatch_bytes"]) * s for s in sizes],
        skew=skew,
        groups=groups,
        top_groups=top_groups,
    )
    return layer


def moe_profile(
    layers: int = 4,
    *,
    batch: int = 8,
    estimate: dict[str, Any] | None = None,
    **kw: Any,
) -> Profile:
    """``layers`` blocks of :func:`moe_layer` (``kw`` goes to each)."""
    meta: dict[str, Any] = {} if estimate is None else {"estimate": estimate}
    return Profile(
        layers=[moe_layer(i, **kw) for i in range(layers)],
        batch_sizes=[1, 2],
        input=[64, 128],
        batch_size=batch,
        meta=meta,
    )
