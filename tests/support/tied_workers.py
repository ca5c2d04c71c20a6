"""Rank workers of parameters used by layers on several ranks: tied weights (a Linear used
twice, GPT-2's LM head) and a parameter every layer reads (DeBERTa's relative embeddings)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.support.dist_models import (
    BATCH,
    CHUNKS,
    REPLICA_CHUNKS,
    loss_fn,
    make_batch,
    param_grads,
)

# Tied parameters: one copy per rank holding a user, the copies' gradients summed.
TIED_STEPS = 3
TIED_VOCAB = 128
TIED_TOKENS = 8


class TiedBlock(nn.Module):
    """A block applying a Linear it may share with another block, then one of its own."""

    def __init__(self, shared: nn.Linear, out: int) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(shared.out_features, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.own(torch.tanh(self.shared(x)))


def make_tied_linear(middle: bool = False) -> nn.Sequential:
    """8 layers whose first and last apply one Linear (``0.shared`` is ``7.shared``), and
    with ``middle`` the fifth as well."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    return nn.Sequential(
        TiedBlock(shared, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        TiedBlock(shared, 8) if middle else nn.Linear(8, 8),
        nn.GELU(),
        nn.Linear(8, 8),
        TiedBlock(shared, 3),
    )


def make_tied_gpt2() -> nn.Module:
    """Hugging Face GPT-2, default config but tiny (its LM head tied to the embedding), no
    dropout (the ranks draw other random numbers than one process)."""
    import transformers

    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=TIED_VOCAB,
        n_positions=TIED_TOKENS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def lm_loss(output: Any, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(output.logits.reshape(-1, TIED_VOCAB), target.reshape(-1))


def tied_case(kind: str) -> tuple[Any, Any, Tensor, Tensor]:
    """The model, its loss and one batch (inputs, targets) of a tied case."""
    generator = torch.Generator().manual_seed(3)
    if kind == "gpt2":
        ids = torch.randint(0, TIED_VOCAB, (BATCH, TIED_TOKENS + 1), generator=generator)
        return make_tied_gpt2(), lm_loss, ids[:, :-1], ids[:, 1:]
    x, y = make_batch()
    return make_tied_linear(middle=kind == "linear3"), loss_fn, x, y


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        # GPT-2's key biases get gradients of rounding noise only (softmax ignores them);
        # Adam's default eps would turn the noise into full steps of either sign.
        return torch.optim.Adam(params, lr=0.01, eps=1e-6)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def tied_runs(world: int) -> list[dict[str, Any]]:
    """The tied cases run on ``world`` ranks: model, schedule, D, v and whether the plan is
    made on rank 0 (else a given balance puts the first and last layers on two ranks)."""
    if world == 2:
        runs = [
            {"kind": kind, "schedule": schedule, "d": 1, "v": 1}
            for kind in ("linear", "gpt2")
            for schedule in ("1f1b", "gpipe")
        ]
        runs.append({"kind": "linear", "schedule": "zb", "d": 1, "v": 2})
        # Stages 0 and 2 on rank 0 use the Linear that stage 3 on rank 1 uses too.
        runs.append({"kind": "linear3", "schedule": "1f1b", "d": 1, "v": 2, "balance": [2] * 4})
        return runs
    return [
        {"kind": "gpt2", "schedule": "1f1b", "d": 1, "v": 1},
        {"kind": "linear", "schedule": "gpipe", "d": 1, "v": 1},
        {"kind": "gpt2", "schedule": "1f1b", "d": 2, "v": 1},
    ]


def _tied_run(run: dict[str, Any], optimizer: str) -> dict[str, Any]:
    """Two steps without ``zero_grad``, then TIED_STEPS optimizer steps: after each, the
    loss and every parameter of this rank (under the model's names)."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    model, loss, x, y = tied_case(run["kind"])
    chunks = REPLICA_CHUNKS if run["d"] > 1 else CHUNKS
    given = None
    if "balance" in run:
        profile = linear_profile([1.0] * len(model))
        options = {"chunks": chunks, "schedule": run["schedule"], "virtual_stages": run["v"]}
        given = evaluate(profile, run["balance"], **options)
    pipe = DistributedPipeline(
        model,
        x,
        loss_fn=loss,
        chunks=chunks,
        schedule=run["schedule"],
        data_parallel=run["d"],
        virtual_stages=run["v"],
        plan=given,
    )
    result: dict[str, Any] = {"balance": pipe.plan.balance, "stages": pipe.stage_indices}
    result["names"] = [name for name, _ in pipe.module.named_parameters()]
    pipe.step(x, y)
    pipe.step(x, y)  # no zero_grad: only each step's own gradients are summed
    result["twice"] = param_grads(pipe)
    pipe.module.zero_grad()
    # A measured balance may leave a rank only layers without parameters (torch's
    # optimizers refuse an empty list): that rank has nothing to update.
    own = list(pipe.module.parameters())
    opt = make_optimizer(optimizer, own) if own else None
    steps = []
    for _ in range(TIED_STEPS):
        value = pipe.step(x, y)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        steps.append({"loss": value, "params": params})
    result["steps"] = steps
    result["state"] = pipe.gather_state_dict()
    return result


def tied(world: int) -> dict[str, Any]:
    """Every tied run with each optimizer, and a written buffer on two ranks refused."""
    from autopipe.distributed import DistributedPipeline

    results: dict[str, Any] = {}
    for index, run in enumerate(tied_runs(world)):
        for optimizer in ("adam", "sgd"):
            results[f"{index} {optimizer}"] = _tied_run(run, optimizer)
    # A buffer that layers on two ranks use and may write cannot be copied.
    norm = nn.BatchNorm1d(8)
    layers = [nn.Sequential(nn.Linear(8, 8), norm), nn.Tanh(), nn.Linear(8, 8)]
    model = nn.Sequential(*layers, nn.Sequential(norm, nn.Linear(8, 3)))
    x, _ = make_batch()
    try:
        DistributedPipeline(model, x, loss_fn=loss_fn, chunks=CHUNKS, deferred_batch_norm=False)
    except ValueError as exc:
        results["refused"] = str(exc)
    return results


# A parameter every layer reads (DeBERTa's relative embeddings, a shared bias): a copy on
# each rank, in float64 with plain SGD so that the pipeline matches one process to rounding.
SHARED_STEPS = 3
SHARED_CHUNKS = 2
SHARED_RUNS = [
    {"kind": "deberta", "schedule": "1f1b", "balance": [3, 2]},
    {"kind": "bias", "schedule": "1f1b", "balance": [2, 2]},
    {"kind": "bias", "schedule": "gpipe", "balance": [1, 3]},
]
SHARED_NAMES = {"deberta": "encoder.rel_embeddings.weight", "bias": "bias"}


def mse(output: Any, target: Tensor) -> Tensor:
    value = output if isinstance(output, Tensor) else output.last_hidden_state
    return (value - target).square().mean()


def shared_case(kind: str) -> tuple[nn.Module, Tensor, Tensor]:
    """The model (float64, whatever the default dtype), one batch of inputs and targets."""
    from tests.support.wrap_models import SharedBias

    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    if kind == "deberta":
        from tests.support.hf_models import deberta_v2

        model = deberta_v2()[0].double()
        x = torch.randint(0, 50, (8, 8), generator=generator)
        return model, x, torch.randn(8, 8, 32, generator=generator, dtype=torch.float64)
    x = torch.randn(8, 8, generator=generator, dtype=torch.float64)
    return SharedBias().double(), x, torch.randn(8, 8, generator=generator, dtype=torch.float64)


def shared_run(run: dict[str, Any]) -> dict[str, Any]:
    """One step's gradients, then SHARED_STEPS SGD steps: after each, the loss and this
    rank's parameters (under the model's names)."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    model, x, y = shared_case(run["kind"])
    profile = linear_profile([1.0] * sum(run["balance"]), batch=len(x), chunks=SHARED_CHUNKS)
    given = evaluate(profile, run["balance"], chunks=SHARED_CHUNKS, schedule=run["schedule"])
    pipe = DistributedPipeline(
        model, x, loss_fn=mse, chunks=SHARED_CHUNKS, schedule=run["schedule"], plan=given
    )
    result: dict[str, Any] = {"balance": pipe.plan.balance}
    result["first"] = pipe.step(x, y)
    result["grads"] = param_grads(pipe)
    pipe.module.zero_grad()
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
    steps = []
    for _ in range(SHARED_STEPS):
        value = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        steps.append({"loss": value, "params": params})
    result["steps"] = steps
    result["state"] = pipe.gather_state_dict()
    return result
