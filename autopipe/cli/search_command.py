"""The ``autopipe plan --search`` command: rank the configurations of the devices."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopipe.cli.inputs import read_profile
from autopipe.cli.options import (
    check_plan_outputs,
    check_precision,
    cost_options,
    default_stages,
    save,
)
from autopipe.cli.target import DEFAULT_PER_NODE, check_target_options, estimated, search_links
from autopipe.planning import SCHEDULES, SEARCH_CHECKPOINTS, PipelineSettings

if TYPE_CHECKING:
    from autopipe.planning import CatalogDevice, MeshLinks, SearchOptions
    from profiler import Profile

__all__: list[str] = []  # internal to the command line


def _check_search_options(args: argparse.Namespace) -> None:
    if args.stages:
        raise ValueError("--search chooses the stages itself: give the devices with --devices")
    if args.strategy != "optimal":
        raise ValueError("--search plans with the optimal strategy: leave out --strategy")
    if args.compare:
        raise ValueError("--compare is not available with --search; use --timeline")
    if args.one_device and (args.target or args.allreduce_bandwidth):
        raise ValueError(
            "--search --one-device ranks stages taking turns on this profile's one device, "
            "with one replica: leave out --target and --allreduce-bandwidth"
        )


def _mesh_options(args: argparse.Namespace) -> dict[str, Any]:
    """The mesh options of ``--search`` as :class:`autopipe.planning.SearchOptions` fields
    (none given: the pipeline x data-parallel search of before)."""
    out: dict[str, Any] = {}
    if args.tensor_parallel is not None:
        out["tensor_parallel"] = args.tensor_parallel
    if args.context_parallel is not None:
        out["context_parallel"] = args.context_parallel or (1,)
    if args.sequence_parallel:
        out["sequence_parallel"] = (False, True)
    if args.zero is not None:
        if args.shard_optimizer:
            raise ValueError("--zero lists the ZeRO stages; leave out --shard-optimizer (ZeRO-1)")
        out["zero"] = args.zero
    if args.expert_parallel is not None:
        out["expert_parallel"] = args.expert_parallel
    if args.micro_batch is not None:
        out["micro_batch"] = args.micro_batch
    if args.sequence is not None:
        out["sequence"] = args.sequence
    if out and args.one_device:
        raise ValueError("--one-device searches no mesh: leave out the mesh options")
    if args.pipeline_parallel:  # not a mesh option: any search may fix its depths
        out["pipeline_parallel"] = args.pipeline_parallel
    return out


def _mesh_links(args: argparse.Namespace, target: CatalogDevice | None) -> MeshLinks | None:
    """The target's intra- and inter-node links for the mesh's groups (``None``: none)."""
    if target is None:
        return None
    from autopipe.planning import GroupLink, MeshLinks

    intra, inter = target.intra_node, target.inter_node
    return MeshLinks(
        GroupLink(intra.bandwidth, intra.latency),
        GroupLink(inter.bandwidth, inter.latency),
        args.per_node or DEFAULT_PER_NODE,
    )


@dataclass(frozen=True)
class SearchInputs:
    """What ``--search`` weighs: the (estimated) profile, the devices, the settings and
    the search's options, as the command line states them."""

    profile: Profile
    devices: int
    settings: PipelineSettings
    options: SearchOptions


def search_inputs(args: argparse.Namespace) -> SearchInputs:
    """The checked inputs of ``autopipe plan --search`` (the model file counted or
    measured, its times estimated for ``--target``), for :func:`autopipe.planning.search`."""
    from autopipe.planning import SearchOptions

    check_precision(args)
    target = check_target_options(args)
    _check_search_options(args)
    costs = cost_options(args, memory_per_stage=False)
    memory = costs.memory
    assert not isinstance(memory, list)  # cost_options refused a list
    devices: int = args.devices or default_stages()
    check_plan_outputs(args)  # --compare is refused above
    mesh = _mesh_options(args)
    if args.global_batch is not None:
        if args.batch is not None and args.batch != args.global_batch:
            raise ValueError("--global-batch and --batch are the same figure: give one of them")
        args.batch = args.global_batch
    # --batch is the step's, across replicas: the layers are measured for the sample's.
    inputs = read_profile(args, devices)
    profile = inputs.profile
    counted = all(layer.shards is not None for layer in profile.layers)
    if args.tensor_parallel is None and counted and not args.one_device and devices > 1:
        # A profile counted with a tensor-parallel plan weighs every degree its heads allow.
        mesh["tensor_parallel"] = ()
    bandwidth, allreduce = costs.bandwidth, costs.allreduce_bandwidth
    if target is not None:
        profile = estimated(profile, args, target)
        memory = memory or target.memory
        links = search_links(args, target, devices)
        bandwidth = bandwidth or links[0]
        allreduce = allreduce or links[1]

    settings = PipelineSettings(
        memory=memory,
        batch=inputs.batch,
        recompute_norms=args.recompute_norms == "on",
        recompute_up_proj=args.recompute_up_proj,
        optimizer=costs.optimizer,
        bandwidth=bandwidth,
        allreduce_bandwidth=allreduce,
    )
    # One device runs its stages in one process, under GPipe's fill-drain.
    schedules = ("gpipe",) if args.one_device else SCHEDULES
    options = SearchOptions(
        schedules=(args.schedule,) if args.schedule else schedules,
        checkpoints=(args.checkpoint,) if args.checkpoint else SEARCH_CHECKPOINTS,
        top=args.top,
        even=args.even,
        virtual_stages=tuple(range(1, args.virtual_stages + 1)),
        shard_optimizer=args.shard_optimizer,
        one_device=args.one_device,
        links=_mesh_links(args, target) if set(mesh) - {"pipeline_parallel"} else None,
        recompute_norms=(False, True) if args.recompute_norms == "auto" else None,
        **mesh,
    )
    return SearchInputs(profile, devices, settings, options)


def search_command(args: argparse.Namespace) -> int:
    """Ranks the configurations of ``--devices`` devices (with ``--one-device``: of up to
    that many stages taking turns on one device), prints them and the best plan."""
    from autopipe.output import render_plan, render_search
    from autopipe.planning import search

    inputs = search_inputs(args)
    plans = search(inputs.profile, inputs.devices, inputs.settings, inputs.options)
    best = plans[0]
    if args.timeline:
        from autopipe.output import draw_timeline

        draw_timeline(best, args.timeline)
    if args.trace:
        from autopipe.output import write_trace

        write_trace(best, args.trace)
    if args.json:
        save(best, args.json, "plan")
    sys.stdout.write(render_search(plans) + "\n\nthe best plan:\n" + render_plan(best))
    if args.json:
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.timeline:
        print(f"timeline written to {args.timeline}", file=sys.stderr)
    if args.trace:
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0
