"""Tiny Hugging Face mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) trained through autopipe's
runners and as plain models, to compare: float64 with plain SGD, real top-2 routing over
4 experts per layer, so that the pipeline's losses and parameters equal the plain model's to
the rounding of a few sums.

With ``router_logits`` the model returns its router logits and load-balancing loss
(``output_router_logits=True``), and the trained loss adds ``router_aux_loss_coef`` times
that loss to the cross-entropy, as the model's own ``loss`` does when given labels. A
pipeline computes that loss once per micro-batch (from the micro-batch's tokens), so its
reference is the plain model run on the same micro-batches (gradient accumulation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

VOCAB = 50
BATCH = 4
TOKENS = 8
CHUNKS = 2
STEPS = 3
LR = 0.5
# The distributed cases: (kind, router_logits, schedule).
DIST_CASES = [
    ("mixtral", False, "1f1b"),
    ("qwen2-moe", False, "gpipe"),
    ("mixtral", True, "1f1b"),
]

_SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 32,
    "num_experts_per_tok": 2,
}


def moe_model(kind: str, router_logits: bool = False) -> nn.Module:
    """A float64 model with default settings but its experts' kernel: the default grouped
    GEMM has no float64 kernel, batched matmuls have (the trace refuses it, naming this)."""
    import transformers

    torch.manual_seed(0)
    if kind == "mixtral":
        config: Any = transformers.MixtralConfig(
            **_SMALL, num_local_experts=4, output_router_logits=router_logits
        )
        model: nn.Module = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3-moe":  # no shared expert, normalized top-k weights
        config = transformers.Qwen3MoeConfig(
            **_SMALL, num_experts=4, moe_intermediate_size=32, output_router_logits=router_logits
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:  # a shared expert beside the routed ones, behind a sigmoid gate
        config = transformers.Qwen2MoeConfig(
            **_SMALL,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            output_router_logits=router_logits,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    model.set_experts_implementation("batched_mm")  # type: ignore[operator]
    return model.double()


def moe_batch() -> tuple[Tensor, Tensor]:
    """Token ids and the next tokens, ``(BATCH, TOKENS)`` each."""
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def lm_loss(output: Any, target: Tensor) -> Tensor:
    """Next-token cross-entropy, plus the weighted router loss when the model returns one."""
    loss = nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))
    if output.get("aux_loss") is not None:
        loss = loss + 0.001 * output.aux_loss  # router_aux_loss_coef's default in both
    return loss


def labels_loss(output: Any, target: Tensor) -> Tensor:
    """The model's own ``loss`` (it was given ``labels``): cross-entropy plus, with router
    logits, ``router_aux_loss_coef`` times the router loss."""
    del target  # the model shifted its labels itself
    loss: Tensor = output.loss
    return loss


def plain_steps(kind: str, router_logits: bool, labels: bool = False) -> dict[str, Any]:
    """The plain model trained STEPS SGD steps: each step's loss and the parameters after
    it. With ``router_logits`` the loss is the mean over CHUNKS micro-batches, as the
    pipelines compute it; else the whole batch's, as the model computes it. With
    ``labels`` the loss is the model's own (:func:`labels_loss`), else :func:`lm_loss`."""
    model = moe_model(kind, router_logits)
    ids, target = moe_batch()
    chunks = CHUNKS if router_logits else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn, steps = (labels_loss if labels else lm_loss), []
    for _ in range(STEPS):
        pairs = zip(ids.tensor_split(chunks), target.tensor_split(chunks))
        extra: Any = (lambda x: {"labels": x}) if labels else (lambda x: {})
        loss = torch.stack([loss_fn(model(x, **extra(x)), y) for x, y in pairs]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps.append({"loss": loss.detach(), "params": params})
    return {"steps": steps}


def distributed_moe() -> dict[str, Any]:
    """One rank's part of each of DIST_CASES on DistributedPipeline (``cases``: its balance,
    and after each SGD step the loss, the last rank's, and this rank's parameters), and the
    error refusing a :class:`Routed` model's uneven micro-batches (``refused``)."""
    from autopipe.distributed import DistributedPipeline

    uneven = torch.randn(5, 5, 6)
    refused = ""
    try:
        DistributedPipeline(Routed(), uneven, loss_fn=lambda out, y: out["aux"], chunks=2)
    except ValueError as exc:
        refused = str(exc)

    ids, target = moe_batch()
    results = []
    for kind, router_logits, schedule in DIST_CASES:
        model = moe_model(kind, router_logits)
        pipe = DistributedPipeline(model, ids, loss_fn=lm_loss, chunks=CHUNKS, schedule=schedule)
        optimizer = torch.optim.SGD(pipe.module.parameters(), lr=LR)
        steps = []
        for _ in range(STEPS):
            loss = pipe.step(ids, target)
            optimizer.step()
            optimizer.zero_grad()
            params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
            steps.append({"loss": loss, "params": params})
        results.append({"balance": pipe.plan.balance, "steps": steps})
    return {"cases": results, "refused": refused}


class _RoutedBlock(nn.Module):
    """A residual block that also scores its tokens for 3 experts, one row per token."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.router = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x + torch.tanh(self.lin(x)), self.router(x.reshape(-1, 6))


class Routed(nn.Module):
    """Returns per-sample values, every block's router logits (``(batch * tokens, 3)``) and
    a 0-d load-balancing-like loss over all tokens, as a dict: ``x`` is ``(batch, tokens, 6)``."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_RoutedBlock() for _ in range(blocks))

    def forward(self, x: Tensor) -> dict[str, Any]:
        logits = []
        for block in self.blocks:
            x, scores = block(x)
            logits.append(scores)
        aux = torch.cat(logits).softmax(-1).mean(0).square().sum()
        return {"out": x, "router": tuple(logits), "aux": aux}
