"""The V schedules' scenario: zbv and dualpipev trained on every rank, float64, SGD."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.support.dist_models import sgd_steps

V_STEPS = 3
LR = 0.1
VOCAB = 32


def make_mlp(seed: int = 0) -> nn.Sequential:
    """Eight Linear+Tanh pairs of width 8, float64: 16 layers, enough for 2K = 8 stages."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers).double()


def make_llama(seed: int = 0) -> nn.Module:
    """A tiny Hugging Face Llama in float64, its head tied to the embedding."""
    from tests.support.hf_models import llama

    torch.manual_seed(seed)
    model, _, _ = llama(
        hidden_size=16, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16,
        tie_word_embeddings=True, use_cache=False,
    )  # fmt: skip
    return model.double()


def mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def lm_loss(output: Any, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def v_case(kind: str, batch: int) -> tuple[nn.Module, Any, Tensor, Tensor]:
    """The model, its loss and one batch (inputs, targets)."""
    generator = torch.Generator().manual_seed(5)
    if kind == "mlp":
        x = torch.randn(batch, 8, generator=generator, dtype=torch.float64)
        y = torch.randn(batch, 8, generator=generator, dtype=torch.float64)
        return make_mlp(), mse, x, y
    ids = torch.randint(0, VOCAB, (batch, 7), generator=generator)
    return make_llama(), lm_loss, ids[:, :-1], ids[:, 1:]


def reference(kind: str, batch: int, chunks: int) -> list[dict[str, Any]]:
    """The plain model's V_STEPS SGD steps on the mean of the micro-batches' losses."""
    model, loss_fn, x, y = v_case(kind, batch)
    return sgd_steps(model, x, y, loss_fn, chunks, V_STEPS, LR)


def _train(kind: str, schedule: str, world: int, trace: str | None) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    chunks = 2 * world
    model, loss_fn, x, y = v_case(kind, 2 * chunks)
    pipe = DistributedPipeline(model, x, loss_fn=loss_fn, chunks=chunks, schedule=schedule)
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    steps = []
    for _ in range(V_STEPS):
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        steps.append({"loss": loss, "params": params})
    result: dict[str, Any] = {"steps": steps, "stages": pipe.stage_indices}
    result["balance"] = pipe.plan.balance
    result["first_last"] = (pipe.is_first, pipe.is_last)
    result["state"] = pipe.gather_state_dict()
    result["own"] = dict(pipe.state_dict())
    if trace is not None:
        pipe.step(x, y, trace=trace)
        opt.zero_grad()
    return result


def _refusal(world: int, **kwargs: Any) -> str:
    from autopipe.distributed import DistributedPipeline

    model, loss_fn, x, _ = v_case("mlp", 4 * world)
    try:
        DistributedPipeline(model, x, loss_fn=loss_fn, **kwargs)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return ""


def v_runs(world: int, workdir: str) -> dict[str, Any]:
    """Every kind and schedule trained on this rank, and the refusals' messages."""
    results: dict[str, Any] = {}
    for kind in ("mlp", "llama"):
        for schedule in ("zbv", "dualpipev"):
            trace = f"{workdir}/trace.json" if (kind, schedule) == ("mlp", "zbv") else None
            results[kind, schedule] = _train(kind, schedule, world, trace)
            print(f"trained {kind} with {schedule}", flush=True)
    k2 = 2 * world
    results["errors"] = {
        "chunks": _refusal(world, chunks=k2 - 1, schedule="dualpipev"),
        "balance": _refusal(world, chunks=k2, schedule="zbv", balance=[8, 8]),
        "checkpoint": _refusal(world, chunks=k2, schedule="zbv", checkpoint="always"),
        "not v": _refusal(world, chunks=k2, schedule="1f1b", balance=[8, 8]),
    }
    # A given balance of the 2K stages is used as given.
    from autopipe.distributed import DistributedPipeline

    model, loss_fn, x, _ = v_case("mlp", 2 * k2)
    balance = [16 - (k2 - 1)] + [1] * (k2 - 1)
    pipe = DistributedPipeline(
        model, x, loss_fn=loss_fn, chunks=k2, schedule="zbv", balance=balance
    )
    results["given"] = pipe.plan.balance
    return results
