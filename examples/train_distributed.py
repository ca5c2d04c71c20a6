"""Trains a small MLP with one pipeline stage per process: ``torchrun --nproc-per-node 2 ...``.

One host, two processes (CPU, gloo)::

    torchrun --nproc-per-node 2 examples/train_distributed.py

Two replicas of a two-stage pipeline on four processes (K·D ranks; ranks 0-1 are replica
0's stages, ranks 2-3 replica 1's; each replica takes half of every mini-batch)::

    torchrun --nproc-per-node 4 examples/train_distributed.py --data-parallel 2

Two virtual stages per rank, interleaved (four stages on two processes; rank 0 holds
stages 0 and 2, rank 1 stages 1 and 3)::

    torchrun --nproc-per-node 2 examples/train_distributed.py --virtual-stages 2

Several hosts (run on each; GPUs use nccl with ``cuda:LOCAL_RANK``)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 examples/train_distributed.py --chunks 8

Rank 0 profiles the model and plans the split (or ``--plan plan.json`` is used); with
``--calibrate`` the ranks first measure their links, the runner's overhead and the model's
compute with every rank busy, so the plan's predicted step time includes them. The last
stage of replica 0 prints the loss of every step (the mean over all replicas).
``--timeout`` bounds how long a rank waits for a failed or stuck peer before it exits with
an error.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from autopipe import Plan
from autopipe.distributed import DistributedPipeline, calibrate_ranks, init_distributed
from profiler import Profile, profile_model


def build_model(width: int = 256, depth: int = 6, classes: int = 10) -> nn.Sequential:
    """An MLP classifier; every rank builds the same one from the same seed."""
    torch.manual_seed(0)
    layers: list[tuple[str, nn.Module]] = [("embed", nn.Linear(32, width)), ("act0", nn.GELU())]
    for i in range(1, depth + 1):
        layers += [(f"fc{i}", nn.Linear(width, width)), (f"act{i}", nn.GELU())]
    layers += [("norm", nn.LayerNorm(width)), ("head", nn.Linear(width, classes))]
    return nn.Sequential(OrderedDict(layers))


def batches(steps: int, batch: int, classes: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic task, identical on every rank (same generator seed)."""
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, classes, generator=generator)
    data = []
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=generator)
        data.append((x, (x @ teacher).argmax(dim=1)))
    return data


def calibrated_profile(
    model: nn.Sequential, sample: torch.Tensor, args: argparse.Namespace
) -> Profile:
    """Rank 0's profile of one replica's batch, calibrated on all ranks (the same on each)."""
    replica = sample[: sample.shape[0] // (args.data_parallel or 1)]
    shared: list[object] = [None]
    if dist.get_rank() == 0:
        shared[0] = profile_model(model, replica, chunks=args.chunks).to_dict()
    dist.broadcast_object_list(shared, src=0)
    profile = Profile.from_dict(shared[0])  # type: ignore[arg-type]
    found = calibrate_ranks(
        profile,
        model=model,
        sample=replica,
        repeats=10,
        virtual_stages=args.virtual_stages,
        schedule=args.schedule,
    )
    overhead = found.get("virtual_overhead_s", found["overhead_s"])
    if dist.get_rank() == 0:
        print(
            f"calibrated: message latency {found['latency_s'] * 1e6:.0f} µs, runner overhead "
            f"{overhead * 1e6:.0f} µs per stage and micro-batch, compute "
            f"{found['compute_scale']:.2f}x the profile with every rank busy",
            flush=True,
        )
    return profile


def load_plan(path: Path) -> Plan:
    """The ``--plan`` file, read on every rank; a bad one stops every rank with one line.

    The ranks first tell each other whether they could read it (a collective): a rank
    that stopped at once could leave another still joining the process group, which
    would then fail with the transport's error instead of this message.
    """
    plan, problem = None, None
    try:
        plan = Plan.load(path)
    except (OSError, ValueError) as exc:  # unreadable, or not a plan
        problem = str(exc)
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    if plan is None or any(everyone):
        found = problem or next(f"rank {k}: {p}" for k, p in enumerate(everyone) if p)
        sys.stderr.write(f"rank {dist.get_rank()}: {found}\n")  # one write: lines stay whole
        sys.stderr.flush()
        dist.destroy_process_group()
        sys.exit(2)
    return plan


def configured(
    model: nn.Sequential, sample: torch.Tensor, device: torch.device, args: argparse.Namespace
) -> DistributedPipeline:
    """The pipeline in the configuration the options give (planned by rank 0)."""
    profile = calibrated_profile(model, sample, args) if args.calibrate else None
    return DistributedPipeline(
        model,
        sample,
        loss_fn=nn.functional.cross_entropy,
        chunks=args.chunks,
        schedule=args.schedule,
        plan=load_plan(args.plan) if args.plan else None,
        device=device,
        data_parallel=args.data_parallel,
        virtual_stages=args.virtual_stages,
        profile=profile,
        checkpoint=args.checkpoint,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global, across replicas")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument(
        "--schedule",
        choices=["1f1b", "gpipe", "zb", "zbv", "dualpipev"],
        default="1f1b",
        help="zbv, dualpipev: V schedules, 2 stages per rank (needs --chunks >= 2 x ranks)",
    )
    parser.add_argument(
        "--checkpoint",
        choices=["never", "always", "except_last", "auto"],
        default=None,
        help="re-compute activations in backward instead of keeping them (default: "
        "except_last, never with zb, zbv and dualpipev)",
    )
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--data-parallel", type=int, default=None, help="replicas D (default: the plan's, or 1)"
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="stages per rank v, interleaved (default 1)"
    )
    parser.add_argument("--plan", type=Path, help="a plan JSON to use instead of planning")
    parser.add_argument("--save", type=Path, help="write the trained model's state_dict here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument(
        "--calibrate", action="store_true", help="measure links and compute before planning"
    )
    parser.add_argument(
        "--search",
        action="store_true",
        help="let autopipe.search choose stages, replicas, micro-batches, checkpointing and "
        "schedule for this world size (--virtual-stages V: also up to V stages per rank)",
    )
    parser.add_argument(
        "--bind-cpus",
        action="store_true",
        help="CPU ranks: bind each to its own share of the host's CPUs (faster messages)",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # processes share the host's cores (--bind-cpus: their share)
    device = init_distributed(timeout=timedelta(seconds=args.timeout), bind_cpus=args.bind_cpus)
    model = build_model()
    data = batches(args.steps, args.batch)
    if args.search:
        searched = {
            "calibrate": args.calibrate,
            "virtual_stages": tuple(range(1, args.virtual_stages + 1)),
        }
        pipe = DistributedPipeline.from_search(
            model,
            data[0][0],
            loss_fn=nn.functional.cross_entropy,
            device=device,
            search_options=searched,
        )
    else:
        try:
            pipe = configured(model, data[0][0], device, args)
        except (OSError, ValueError) as exc:
            # A --plan not for this model: one line per rank, no traceback (the runner
            # refuses it on every rank, after the ranks compared their figures).
            sys.stderr.write(f"rank {dist.get_rank()}: {exc}\n")  # one write: lines stay whole
            sys.stderr.flush()
            dist.destroy_process_group()
            sys.exit(2)
    rank = dist.get_rank()
    if rank == 0:
        plan = pipe.plan
        times = [f"{s.time * 1e3:.2f}" for s in plan.stages]
        replicas = f" x {plan.data_parallel} replicas" if plan.data_parallel > 1 else ""
        line = (
            f"plan: balance {plan.balance}{replicas}, stage ms per micro-batch {times}, "
            f"predicted step {plan.step_time * 1e3:.1f} ms"
        )
        print(line, flush=True)
    print(f"rank {rank}: {pipe}", flush=True)

    optimizer: torch.optim.Optimizer
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(pipe.module.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(pipe.module.parameters(), lr=args.lr * 10, momentum=0.9)
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = pipe.step(x, y)
        optimizer.step()
        if loss is not None and pipe.replica_index == 0:  # every replica has the same loss
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    state = pipe.gather_state_dict()
    if state is not None and args.save:
        torch.save(state, args.save)  # loads into build_model() as is
        print(f"saved {len(state)} tensors to {args.save}", flush=True)
    dist.barrier()  # leave together: a gloo group torn down while a peer still talks aborts
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
