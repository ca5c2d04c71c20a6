"""Published training runs of Llama 3 models: their shapes, meshes and measured speed.

Two sources, each row as published:

- Megatron-LM's own Llama 3 runs on H100 in FP8 (``examples/llama/README.md`` of
  NVIDIA/Megatron-LM, "FP8 Performance"): GPUs, global and micro-batch, sequence, TP, PP,
  CP, VP, and the measured tokens/s and TFLOP/s per GPU.
- "The Llama 3 Herd of Models" (Meta, 2024), Table 4: Llama 3 405B pre-training on H100s
  in bfloat16, TP 8, PP 16, with CP 1 at 8,192 tokens and CP 16 at 131,072.

TFLOP/s per GPU is model FLOPs per step over the step's seconds and the GPUs. Both sources
count model FLOPs the way Megatron-LM's ``num_floating_point_operations`` does (its
training loop logs them): every GEMM three times (forward, two backward), attention's two
batched products over the whole ``s × s`` score matrix (no causal discount) and the output
layer's logits; :func:`flops_per_token` is that count. It reproduces Megatron's table from
its tokens/s (8B and 70B to within 0.2%, 405B 0.8% below its 834: 827 from its 315
tokens/s; ``benchmarks/tests/test_published_runs.py``), and the Llama 3
paper's TFLOP/s from its MFU and the H100's 989 TFLOP/s dense bfloat16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LLAMA3", "LLAMA3_PAPER", "MEGATRON", "RUNS", "PublishedRun", "Shape", "flops_per_token"]

MEGATRON = "NVIDIA/Megatron-LM examples/llama/README.md, FP8 Performance"
LLAMA3_PAPER = "The Llama 3 Herd of Models (2024), Table 4"


@dataclass(frozen=True)
class Shape:
    """A Llama-3-shaped decoder: what its FLOPs and its meta model are built from."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256


LLAMA3 = {
    "8b": Shape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "70b": Shape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8),
    "405b": Shape(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8),
}


@dataclass(frozen=True)
class PublishedRun:
    """One published run: the model, the cluster, the mesh and what it measured.

    Attributes:
        name: a short label.
        model: a key of :data:`LLAMA3`.
        gpus: H100s in the run.
        global_batch: sequences per step.
        micro_batch: sequences per micro-batch.
        sequence: tokens per sequence.
        tp, pp, cp, vp: tensor, pipeline, context parallel degrees; virtual stages per
            pipeline rank.
        dtype: ``float8`` (Megatron's FP8 recipe: the linear layers' GEMMs in FP8) or
            ``bfloat16``.
        tflops: the published TFLOP/s per GPU.
        tokens: the published tokens/s per GPU (0 where not published).
        source: where it is published.
    """

    name: str
    model: str
    gpus: int
    global_batch: int
    micro_batch: int
    sequence: int
    tp: int
    pp: int
    cp: int
    vp: int
    dtype: str
    tflops: float
    tokens: float
    source: str

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the GPUs left over the model-parallel ones."""
        return self.gpus // (self.tp * self.pp * self.cp)


RUNS = (
    PublishedRun("megatron-8b", "8b", 8, 128, 1, 8192, 1, 1, 2, 1, "float8", 800, 13812, MEGATRON),
    PublishedRun(
        "megatron-70b", "70b", 64, 128, 1, 8192, 4, 8, 1, 5, "float8", 780, 1621, MEGATRON
    ),
    PublishedRun(
        "megatron-405b", "405b", 1024, 512, 1, 8192, 8, 8, 2, 8, "float8", 834, 315, MEGATRON
    ),
    # Table 4: batch size per DP 32 and 16 sequences, 16M tokens per batch; micro-batch 1.
    PublishedRun(
        "llama3-405b-8k", "405b", 8192, 2048, 1, 8192, 8, 16, 1, 1, "bfloat16", 430, 0,
        LLAMA3_PAPER,
    ),
    PublishedRun(
        "llama3-405b-16k", "405b", 16384, 2048, 1, 8192, 8, 16, 1, 1, "bfloat16", 400, 0,
        LLAMA3_PAPER,
    ),
    PublishedRun(
        "llama3-405b-131k", "405b", 16384, 128, 1, 131072, 8, 16, 16, 1, "bfloat16", 380, 0,
        LLAMA3_PAPER,
    ),
)  # fmt: skip


def flops_per_token(shape: Shape, sequence: int) -> float:
    """Model FLOPs of one training token (forward and backward), Megatron's count.

    Per layer: the query, key/value and output projections, the gated MLP's three GEMMs,
    and attention's scores and weighted sum over all ``sequence`` keys; then the logits.
    Each GEMM of ``m × n`` by ``n × k`` is ``2mnk`` FLOPs, run three times in a step.
    """
    h = shape.hidden
    groups = shape.kv_heads / shape.heads
    attention = h * h * (2 + 2 * groups) + 2 * sequence * h  # q, o, k, v; scores, sum
    mlp = 3 * h * shape.ffn  # gate, up, down
    logits = h * shape.vocab
    return 6.0 * (shape.layers * (attention + mlp) + logits)
