"""What the single-process pipeline tests share: the CPU device, the CUDA mark, and a count
of the pipeline's worker threads."""

from __future__ import annotations

import threading

import pytest
import torch

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def worker_threads() -> int:
    """Live autopipe worker threads; other libraries may start threads of their own."""
    return sum(t.name.startswith("autopipe-worker") for t in threading.enumerate())


def has_node(output: torch.Tensor, name: str) -> bool:
    """Whether the autograd graph behind ``output`` has a node of class ``name``."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False
