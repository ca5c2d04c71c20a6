"""A Llama-3-405B-shaped model on the meta device (see ``llama3_70b.py``)::

    autopipe plan examples/llama3_405b.py --target h200 --search --devices 64 \\
        --per-node 8 --optimizer adam-mixed --shard-optimizer

126 decoder blocks of hidden size 16384 (FFN 53248, 128 heads, 8 key/value heads): about
406 billion parameters. With 16 bytes per parameter it needs 6.5 TB for weights, gradients
and optimizer state, more than 64 H100s (80 GB each) hold with pipeline and data
parallelism alone; autopipe says by how much.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama3_70b import BATCH, SEQUENCE, llama


def model() -> torch.nn.Module:
    """Llama-3-405B's shape."""
    return llama(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8)


def sample() -> torch.Tensor:
    """Token ids of one mini-batch."""
    return torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
