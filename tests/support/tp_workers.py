"""Ranks of the tensor-parallel scenarios: a tiny Llama trained on K·t ranks and in one process."""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers
from torch import Tensor, nn

from tests.support.dist_models import sgd_steps

TP_CHUNKS = 2
TP_STEPS = 3
LR = 0.1
# The layout of each run: (K stages, t tensor ranks, key/value heads), by world size; the
# ranks left over are data-parallel replicas (4 ranks at K=1, t=2: D=2). One key/value head
# cannot be split over t=2: its projections run replicated.
RUNS = {4: [(2, 2, 2), (1, 2, 2)], 2: [(1, 2, 2), (2, 1, 2), (1, 2, 1)]}


class RMSNorm64(nn.Module):
    """Llama's RMSNorm computed in the input's dtype.

    Hugging Face's ``LlamaRMSNorm`` normalizes in float32 whatever the model's dtype, so
    a float64 model agrees with its pipeline only to float32 rounding wherever a sum's
    order changes (the all-reduces do); this one keeps float64 throughout.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps))


def tiny_llama(heads: int = 4, kv_heads: int = 2, hidden: int = 64) -> nn.Module:
    """A float64 Llama of 2 layers with its default tensor-parallel plan, eager attention
    and float64 norms (:class:`RMSNorm64`)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=50,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).double()
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "LlamaRMSNorm":
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, RMSNorm64(module))
    return model


def batch() -> tuple[Tensor, Tensor]:
    """Token ids (4 × 8) and next-token targets."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (4, 9), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def token_loss(output: Any, target: Tensor) -> Tensor:
    logits = output.logits if not isinstance(output, Tensor) else output
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def reference(kv_heads: int = 2) -> dict[str, Any]:
    """The plain model trained as the pipelines are: losses and final state."""
    model = tiny_llama(kv_heads=kv_heads)
    x, y = batch()
    steps = sgd_steps(model, x, y, token_loss, TP_CHUNKS, TP_STEPS, LR)
    return {"losses": [s["loss"] for s in steps], "state": copy.deepcopy(model.state_dict())}


def tp_run(stages: int, tensor: int, kv_heads: int = 2) -> dict[str, Any]:
    """TP_STEPS SGD steps of the pipeline: losses, gradient placements, gathered state."""
    from torch.distributed.tensor import DTensor

    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    model, (x, y) = tiny_llama(kv_heads=kv_heads), batch()
    units = 6  # embedding, rotary, 2 layers, norm, head
    balance = [units // stages] * stages
    profile = linear_profile([1.0] * units, batch=len(x), chunks=TP_CHUNKS)
    replicas = torch.distributed.get_world_size() // (stages * tensor)
    given = evaluate(profile, balance, chunks=TP_CHUNKS, schedule="1f1b", data_parallel=replicas)
    pipe = DistributedPipeline(
        model,
        x,
        loss_fn=token_loss,
        chunks=TP_CHUNKS,
        plan=given,
        tensor_parallel=tensor,
        data_parallel=replicas,
    )
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    losses, placements = [], {}
    for step in range(TP_STEPS):
        losses.append(pipe.step(x, y))
        if step == 0:
            placements = {
                name: (str(p.placements), str(p.grad.placements))
                for name, p in pipe.named_parameters()
                if isinstance(p, DTensor) and isinstance(p.grad, DTensor)
            }
        opt.step()
        opt.zero_grad()
    return {
        "layout": (stages, tensor, kv_heads),
        "stage": pipe.stage_index,
        "tensor_index": pipe.tensor_index,
        "losses": losses,
        "placements": placements,
        "state": pipe.gather_state_dict(),
    }


def refused(world: int) -> str:
    """The message every rank gets for an unknown style."""
    from autopipe.distributed import DistributedPipeline

    model, (x, _) = tiny_llama(), batch()
    try:
        DistributedPipeline(
            model,
            x,
            loss_fn=token_loss,
            chunks=2,
            tensor_parallel=world,
            tp_plan={"lm_head": "diagonal"},
        )
    except ValueError as exc:
        return str(exc)
    return "built"


def tensor_parallel(world: int) -> dict[str, Any]:
    """Every run for this world size, the reference, and the refusal."""
    return {
        "runs": [tp_run(k, t, kv) for k, t, kv in RUNS[world]],
        "reference": {kv: reference(kv) for kv in {kv for _, _, kv in RUNS[world]}},
        "refused": refused(world),
    }
