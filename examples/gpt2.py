"""A GPT-2-shaped Hugging Face model, for ``autopipe plan examples/gpt2.py --stages 4``.

Built from a config with random weights (nothing is downloaded); needs ``transformers``.
It is not an ``nn.Sequential``: autopipe traces it (with transformers 5 torch.fx cannot,
so torch.export does, in non-strict mode) and cuts it between its blocks (the token and
position embeddings, each transformer block, the final norm and the LM head). Its LM head
is tied to the token embedding, as in GPT-2: a split puts a copy on each stage that uses it.

Run as a script under torchrun it trains the model with one pipeline stage per process
(CPU, gloo), the tied head included::

    torchrun --nproc-per-node 2 examples/gpt2.py --steps 5
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch
import transformers


def model(layers: int = 12) -> torch.nn.Module:
    """A GPT-2 of width 256 (12 blocks: about 7M parameters besides the embeddings)."""
    config = transformers.GPT2Config(
        n_layer=layers,
        n_head=8,
        n_embd=256,
        vocab_size=8192,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    config._attn_implementation = "eager"  # plain attention ops, which torch.export traces
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def sample() -> torch.Tensor:
    """A mini-batch of 16 sequences of 128 token ids."""
    return torch.randint(0, 8192, (16, 128), generator=torch.Generator().manual_seed(0))


def batches(steps: int) -> list[torch.Tensor]:
    """Token ids for each step, the same on every rank (the first is :func:`sample`)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 8192, (16, 128), generator=generator) for _ in range(steps)]


def next_token_loss(output: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's prediction of the next token."""
    logits = output["logits"][:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Trains the GPT-2 under torchrun.")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="of the weights"
    )
    parser.add_argument("--save", type=Path, help="write the trained model's state_dict here")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
    import torch.distributed as dist

    from autopipe.distributed import DistributedPipeline, init_distributed

    torch.set_num_threads(1)  # the processes share the host's cores
    device = init_distributed(timeout=timedelta(minutes=5))
    data = batches(args.steps)
    pipe = DistributedPipeline(
        model(args.layers).to(getattr(torch, args.dtype)),
        data[0],
        loss_fn=next_token_loss,
        chunks=args.chunks,
        schedule=args.schedule,
        device=device,
    )
    if dist.get_rank() == 0:
        tied = "; ".join(f"{' = '.join(t.names)} on stages {t.stages}" for t in pipe.plan.tied)
        print(f"plan: balance {pipe.plan.balance}; tied: {tied or 'none'}", flush=True)
    optimizer_class = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    optimizer = optimizer_class(pipe.module.parameters(), lr=args.lr)
    for step, tokens in enumerate(data):
        optimizer.zero_grad()
        loss = pipe.step(tokens, tokens)
        optimizer.step()
        if loss is not None:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
    state = pipe.gather_state_dict()
    if args.save is not None and state is not None:
        torch.save(state, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
