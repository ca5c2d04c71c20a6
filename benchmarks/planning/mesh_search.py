"""How long the mesh search takes on a Llama-3-405B-shaped profile over 16,384 H100s.

The profile is written by hand from the model's shape (126 decoder blocks of hidden size
16384, FFN 53248, 128 query and 8 key/value heads, vocabulary 128256; bfloat16, sequence
8192; an embedding and a head layer), with each layer's counted FLOPs, traffic, saved
bytes and shard counts at 1 and 2 samples (Megatron's rules: the projections and
attention shard over ``t``; 24 of a block's 34 saved bytes per token and hidden unit
shard, the other 10 are what sequence parallelism divides; two all-reduces of the block's
output size per pass). Its times are estimated for the catalog's H100 (a roofline at the
default efficiencies). The search weighs TP 1-8, CP 1-8, sequence parallelism, ZeRO 0-3,
every K and D with t·c·K·D = 16,384, 1 to 8 virtual stages, GPipe and 1F1B and every
checkpoint mode, global batch 2048, micro-batch 1, Adam in mixed precision, 80 GB per
device, NVLink inside nodes of 8 and 400 Gb/s between them. Reported: wall time and
peak resident memory of one search (profile construction and estimate included), the
configurations and the best plans.

Run: ``python -m benchmarks.planning.mesh_search``; results go to
``benchmarks/results/mesh_search.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autopipe.output import render_search
from autopipe.planning import (
    GroupLink,
    MeshLinks,
    SearchOptions,
    estimate_profile,
    find_device,
    search,
)
from profiler import LayerProfile, Profile, ShardCounts

RESULTS = Path(__file__).resolve().parents[1] / "results"
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 16384, 53248, 128, 8, 128
VOCAB, LAYERS, SEQUENCE, BYTES = 128256, 126, 8192, 2
SIZES = (1, 2)


def _per(value: float) -> list[float]:
    return [value * s for s in SIZES]


def _ints(value: float) -> list[int]:
    return [round(value * s) for s in SIZES]


def block(index: int) -> LayerProfile:
    """One decoder block at 1 and 2 samples of SEQUENCE tokens."""
    h, s, kv = HIDDEN, SEQUENCE, KV_HEADS * HEAD_DIM
    params = 2 * h * h + 2 * h * kv + 3 * h * FFN  # q, o, k, v and the SwiGLU MLP
    attention = 4.0 * s * s * h  # scores and their product with the values
    matmuls = 2.0 * params * s
    elementwise = 20.0 * s * h  # norms, residual sums, the activation
    flops = matmuls + attention + elementwise
    acts = s * (12 * h + 6 * FFN) * BYTES  # what the operations read and write
    traffic = params * BYTES + acts
    norms = 8.0 * s * h * BYTES
    saved, sharded_saved, replicated = 34 * s * h, 24 * s * h, 10 * s * h
    reduce = 2 * s * h * BYTES
    shards = ShardCounts(
        flops=_per(matmuls + attention),
        backward_flops=_per(2 * (matmuls + attention)),
        backward_input_flops=_per(matmuls / 2 + 2 * attention),
        traffic=_per(traffic - norms),
        backward_traffic=_per(2 * (traffic - norms)),
        saved=_ints(sharded_saved),
        param_bytes=params * BYTES,
        reduce_forward=_ints(reduce),
        reduce_backward=_ints(reduce),
        reductions=2,
        replicated_saved=_ints(replicated),
        attention_flops=_per(attention),
        attention_backward_flops=_per(2 * attention),
        kv_bytes=_ints(2 * s * kv * BYTES),
        attention_calls=1,
        heads=HEADS,
        kv_heads=KV_HEADS,
    )
    return LayerProfile(
        name=f"layers.{index}",
        kind="LlamaDecoderLayer",
        forward=[0.0, 0.0],
        backward=[0.0, 0.0],
        saved=_ints(saved),
        output=_ints(s * h * BYTES),
        param_bytes=params * BYTES,
        flops=_per(flops),
        backward_flops=_per(2 * flops),
        backward_input_flops=_per(matmuls / 2 + 2 * attention + elementwise),
        traffic=_per(traffic),
        backward_traffic=_per(2 * traffic),
        shards=shards,
    )


def vocabulary(name: str, head: bool) -> LayerProfile:
    """The embedding (a lookup) or the head (a projection onto the vocabulary)."""
    s, h, params = SEQUENCE, HIDDEN, VOCAB * HIDDEN
    flops = 2.0 * s * h * VOCAB if head else 0.0
    out = s * (VOCAB if head else h) * BYTES
    traffic = params * BYTES + out if head else 2.0 * s * h * BYTES
    shards = ShardCounts(
        flops=_per(flops), backward_flops=_per(2 * flops), backward_input_flops=_per(flops),
        traffic=_per(traffic), backward_traffic=_per(2 * traffic),
        saved=_ints(out if head else 0), param_bytes=params * BYTES,
        reduce_forward=_ints(0 if head else s * h * BYTES),
        reduce_backward=_ints(s * h * BYTES if head else 0),
        reductions=1, replicated_saved=_ints(0), attention_flops=_per(0),
        attention_backward_flops=_per(0), kv_bytes=_ints(0),
    )  # fmt: skip
    return LayerProfile(
        name=name, kind="Linear" if head else "Embedding", forward=[0.0, 0.0],
        backward=[0.0, 0.0], saved=_ints(out if head else 0),
        output=_ints(out if head else s * h * BYTES),
        param_bytes=params * BYTES, flops=_per(flops), backward_flops=_per(2 * flops),
        backward_input_flops=_per(flops), traffic=_per(traffic),
        backward_traffic=_per(2 * traffic), shards=shards,
    )  # fmt: skip


def llama_405b() -> Profile:
    """The counted profile (times 0 until estimated)."""
    layers = [vocabulary("embed_tokens", False), *(block(i) for i in range(LAYERS))]
    layers.append(vocabulary("lm_head", True))
    return Profile(
        layers=layers, batch_sizes=list(SIZES), input=_ints(SEQUENCE * 8), batch_size=2048,
        dtype="bfloat16",
    )  # fmt: skip


def run(devices: int, batch: int) -> dict[str, Any]:
    """One search; its seconds, configurations and best plans."""
    start = time.perf_counter()
    h100 = find_device("h100")
    profile = estimate_profile(llama_405b(), h100)
    links = MeshLinks(
        GroupLink(h100.intra_node.bandwidth, h100.intra_node.latency),
        GroupLink(h100.inter_node.bandwidth, h100.inter_node.latency),
        per_node=8,
    )
    options = SearchOptions(
        tensor_parallel=(1, 2, 4, 8),
        context_parallel=(1, 2, 4, 8),
        sequence_parallel=(False, True),
        zero=(0, 1, 2, 3),
        micro_batch=1,
        sequence=SEQUENCE,
        links=links,
        virtual_stages=(1, 2, 4, 8),
        top=5,
    )
    plans = search(
        profile, devices, memory=h100.memory, batch=batch, optimizer="adam-mixed",
        options=options,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    table = render_search(plans)
    return {
        "devices": devices,
        "global_batch": batch,
        "seconds": round(seconds, 1),
        "peak_memory_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "notes": plans[0].notes,
        "table": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args.devices, args.batch)
    result["meta"] = {"host": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mesh_search.json").write_text(json.dumps(result, indent=2))
    text = (
        f"# The mesh search on a Llama-3-405B shape\n\n{args.devices} H100s, global batch "
        f"{args.batch}, micro-batch 1, sequence {SEQUENCE}: {result['seconds']} s, peak "
        f"resident memory {result['peak_memory_gib']} GiB on {result['meta']['cpus']} CPUs.\n\n"
        f"```text\n{result['table']}\n```\n"
    )
    (args.out / "mesh_search.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
