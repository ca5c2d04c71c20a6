"""What one device of an expert-parallel mesh sees of a profile's routed experts.

From each layer's :class:`profiler.expert_counts.ExpertCounts`, at expert-parallel degree
``e`` (:attr:`autopipe.planning.model.mesh.Mesh.expert`):

- **The rule.** ``e`` divides ``D·c`` (the expert-parallel groups are carved from the
  ranks that replicate a stage, Megatron's expert-model-parallel groups inside its data-
  and context-parallel ranks) and every mixture-of-experts block's expert count ``E``.
- **Parameters.** A device holds ``P_x / e`` of the routed experts' bytes ``P_x``, not
  divided by the tensor-parallel group (expert tensor parallelism 1): their state shards,
  and their ZeRO-2/3 exchanges run, over the ``S_x = t·D·c / e`` devices holding the
  same experts (:meth:`autopipe.planning.model.mesh.Mesh.expert_replicas`); their
  exchange after the drain is priced at the dense part's rate per byte (the cost model
  has one rate per stage: more than their own ring's where ``S_x < S``). The
  tensor-parallel plan's shard counts apply to the rest of the layer (at most all of it).
- **Compute and saved bytes.** A device runs its own tokens' share of the experts (``1/c``
  of the routed tokens, ``1/t`` of them too under sequence parallelism), whatever ``e``;
  with a routing skew ``S`` (the busiest expert receives ``S`` times the mean) the device
  holding the busiest expert, which every other waits for at the all-to-all, receives
  ``σ = 1 + (S − 1)·(e − 1)/(E − 1)`` times the mean device's tokens (its ``E/e``
  experts: the busiest at ``S`` times the mean, the others sharing what is left evenly),
  so its routed-expert FLOPs and saved bytes are ``σ`` times the balanced ones (``σ = 1``
  at ``e = 1``; ``σ = S`` at ``e = E``). Of the experts' memory traffic (counted as a
  grouped kernel moves it, each expert on its own rows; in older profiles their FLOPs'
  share of the layer's), their weights' bytes, read forward and read and written as
  gradients backward, are the device's ``1/e`` whatever its tokens: without expert
  parallelism every device reads every expert for a few tokens each, which is what
  keeps small micro-batches of experts memory-bound.
- **All-to-all.** Each forward of a block dispatches the device's routed token copies to
  the experts' devices and combines them back, two all-to-alls each sending
  ``(e−1)/e`` of them: ``2 · (e−1)/e · dispatch / (c·r) / bandwidth`` plus a latency
  per all-to-all (``r = t`` under sequence parallelism, else 1), the backward the same.
  They run on the link the expert-parallel group spans
  (:func:`autopipe.planning.mesh.mesh_links.group_link`, ``ep``) and are not overlapped
  with compute: all of it is exposed.
- **Node-limited routing.** Where the router first chooses ``top_groups`` of ``groups``
  groups of experts (DeepSeek-V3: 4 of 8) and the group spans ``n`` nodes that each hold
  whole groups (``n`` divides ``groups``) and ``m = e/n`` of its ranks, a token crosses
  to each other node its experts lie on once, ``(n − 1)·(1 − q)`` nodes on average
  (:func:`remote_nodes`), and that node forwards it to the ranks holding its experts,
  ``(m − 1)/m`` of its ``top_k`` copies, over the intra-node link: DeepSeek's dispatch,
  whose two legs run at once, so each all-to-all takes the longer of the two.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.mesh.mesh_links import GroupLink
from autopipe.planning.model.layer_costs import ProfileLines, saved_factor
from autopipe.planning.model.mesh import Mesh
from profiler import Profile

if TYPE_CHECKING:
    from autopipe.planning.mesh.shard_table import ShardTable

__all__: list[str] = []

Array = NDArray[np.float64]
# The counts whose routed-expert part the straggler scales, with the FLOPs they go by.
_FLOPS = ("flops", "backward_flops", "backward_input_flops")
_TRAFFIC = {"traffic": "flops", "backward_traffic": "backward_flops"}
# The experts' traffic that does not follow the tokens, as counted; in older profiles,
# their weight bytes moved so many times: read forward; read for the input's gradient and
# written as their own gradient backward.
_WEIGHT_TRAFFIC = {"traffic": "weight_traffic", "backward_traffic": "backward_weight_traffic"}
_WEIGHT_PASSES = {"traffic": 1.0, "backward_traffic": 2.0}
# The measured times, with the FLOPs whose expert share they scale by.
_TIMES = {
    "forward": "flops",
    "backward": "backward_flops",
    "backward_input": "backward_input_flops",
}


@dataclass(frozen=True)
class ExpertTable:
    """Every layer's routed experts as arrays (0 for a layer without them).

    Attributes:
        experts: routed experts per block, per layer.
        blocks: mixture-of-experts blocks per layer.
        top_k: experts each token goes to, per layer.
        param_bytes: the routed experts' parameter bytes, per layer.
        counts: ``flops``, ``backward_flops``, ``backward_input_flops``, ``saved``,
            ``dispatch_bytes``, ``traffic`` and ``backward_traffic`` (NaN where the
            profile did not count them) of the routed experts, layers × batch sizes.
        skew: the busiest expert's tokens over the mean, per layer (1: balanced).
        groups: groups the router chooses among, per layer (1: no group limit).
        top_groups: groups a token's experts come from, per layer.
    """

    experts: NDArray[np.int64]
    blocks: NDArray[np.int64]
    top_k: NDArray[np.int64]
    param_bytes: Array
    counts: dict[str, Array]
    skew: Array
    groups: NDArray[np.int64]
    top_groups: NDArray[np.int64]

    @classmethod
    def from_profile(cls, profile: Profile) -> ExpertTable | None:
        """The profile's routed experts, or ``None`` when no layer has any."""
        layers = profile.layers
        if all(layer.experts is None or not layer.experts.blocks for layer in layers):
            return None
        zeros = [0.0] * len(profile.batch_sizes)
        found = [
            layer.experts if layer.experts and layer.experts.blocks else None for layer in layers
        ]

        def scalar(what: str, default: float = 0.0) -> Array:
            return np.array([float(getattr(x, what)) if x else default for x in found])

        names = (*_FLOPS, "saved", "dispatch_bytes")
        unknown = [math.nan] * len(profile.batch_sizes)

        def traffic(what: str) -> Array:
            # NaN where the profile predates the experts' own traffic.
            rows = [(getattr(x, what) if x else zeros) or unknown for x in found]
            return np.array(rows, dtype=float)

        counts = {
            **{
                what: np.array([getattr(x, what) if x else zeros for x in found], dtype=float)
                for what in names
            },
            **{what: traffic(what) for what in (*_TRAFFIC, *_WEIGHT_TRAFFIC.values())},
        }
        factor = saved_factor(profile)
        if factor is not None:  # the FP8 recipe's saved bytes, as the layer's whole ones
            counts["saved"] = counts["saved"] * factor
        return cls(
            experts=scalar("experts").astype(np.int64),
            blocks=scalar("blocks").astype(np.int64),
            top_k=scalar("top_k").astype(np.int64),
            param_bytes=scalar("param_bytes"),
            counts=counts,
            skew=scalar("skew", 1.0),
            groups=scalar("groups", 1.0).astype(np.int64),
            top_groups=scalar("top_groups", 1.0).astype(np.int64),
        )

    @property
    def common(self) -> int:
        """The greatest common divisor of the layers' expert counts."""
        return math.gcd(*(int(x) for x in self.experts if x > 0))

    def degrees(self, ranks: int) -> list[int]:
        """The expert-parallel degrees the rule allows among ``ranks = D·c`` devices."""
        common = self.common
        return [e for e in range(1, ranks + 1) if ranks % e == 0 and common % e == 0]

    def straggler(self, expert: int) -> Array:
        """Per layer, ``σ``: the busiest device's routed tokens over the mean device's."""
        many = self.experts > 1
        spread = np.where(many, (expert - 1) / np.where(many, self.experts - 1, 1), 0.0)
        return np.asarray(1.0 + (self.skew - 1.0) * spread)


def expert_refusal(table: ExpertTable | None, mesh: Mesh, replicas: int) -> str | None:
    """Why expert parallelism ``mesh.expert`` cannot run the profile, in one line, or
    ``None``."""
    e, ranks = mesh.expert, replicas * mesh.context
    if e == 1:
        return None
    if table is None:
        return f"expert parallelism {e} needs a profile whose layers have routed experts"
    if ranks % e:
        return (
            f"expert parallelism {e} must divide the data-parallel replicas times the "
            f"context-parallel degree ({replicas} x {mesh.context} = {ranks})"
        )
    if table.common % e:
        counts = sorted({int(x) for x in table.experts if x > 0})
        return (
            f"expert parallelism {e} must divide every block's routed experts "
            f"({', '.join(map(str, counts))})"
        )
    return None


def _share(part: Array, total: Array) -> Array:
    safe = np.where(total > 0, total, 1.0)
    return np.where(total > 0, np.clip(part / safe, 0.0, 1.0), 0.0)


def expert_view(
    lines: ProfileLines, table: ShardTable, experts: ExpertTable, mesh: Mesh
) -> tuple[ProfileLines, ShardTable]:
    """The lines and shard table whose tensor- and context-parallel division gives one
    device's figures with routed experts (see the module docstring).

    The experts' part ``X`` of a count becomes ``σ·X`` of the layer's total and leaves
    the sharded part (``min(sharded, total − X)``): divided as replicated figures are
    (by ``c``, and by ``t`` under sequence parallelism), it is the straggler's share. The
    experts' saved bytes join ``replicated_saved`` (divided by ``t`` under sequence
    parallelism); their traffic is their own (or, in older profiles, their FLOPs' share
    of the layer's), and of it their
    weights' bytes (``P_x`` forward, ``2·P_x`` backward, at most all of it) are the
    device's ``1/e`` while the rest is the straggler's share; measured times scale with
    the FLOPs they carry. Parameters: ``P − P_x + P_x / e``.
    """
    sigma = experts.straggler(mesh.expert)[:, None]
    x = experts.counts
    counts, shards, values = dict(table.counts), dict(table.shards), dict(lines.values)
    for what in _FLOPS:
        rest = np.maximum(counts[what] - x[what], 0.0)
        shards[what] = np.minimum(shards[what], rest)
        counts[what] = counts[what] + x[what] * (sigma - 1.0)
    for what, by in _TRAFFIC.items():
        # Their own traffic where counted, else their FLOPs' share of the layer's.
        shared = counts[what] * _share(x[by], table.counts[by])
        part = np.where(np.isnan(x[what]), shared, np.minimum(np.nan_to_num(x[what]), counts[what]))
        shards[what] = np.minimum(shards[what], np.maximum(counts[what] - part, 0.0))
        # Of it, the experts' weights (read forward; read and their gradients written
        # backward) are the device's 1/e whatever the tokens; the rest follows the tokens.
        counted = x[_WEIGHT_TRAFFIC[what]]
        passes = _WEIGHT_PASSES[what] * experts.param_bytes[:, None]
        weights = np.minimum(np.where(np.isnan(counted), passes, np.nan_to_num(counted)), part)
        tokens = part - weights
        counts[what] = counts[what] + tokens * (sigma - 1.0) - weights * (1.0 - 1.0 / mesh.expert)
    for what, by in _TIMES.items():
        total = table.counts[by]
        ratio = np.where(total > 0, counts[by] / np.where(total > 0, total, 1.0), 1.0)
        values[what] = values[what] * ratio
    saved = x["saved"]
    rest = np.maximum(values["saved"] - saved, 0.0)
    shards["saved"] = np.minimum(shards["saved"], rest)
    replicated = np.minimum(shards["replicated_saved"], np.maximum(rest - shards["saved"], 0.0))
    shards["replicated_saved"] = replicated + saved * sigma
    values["saved"] = values["saved"] + saved * (sigma - 1.0)
    dense = np.maximum(lines.params - experts.param_bytes, 0.0)
    own = experts.param_bytes / mesh.expert
    lines = dataclasses.replace(lines, values=values, params=dense + own, experts=own)
    table = dataclasses.replace(
        table,
        counts=counts,
        shards=shards,
        sharded_params=np.minimum(table.sharded_params, dense),
    )
    return lines, table


def remote_nodes(groups: NDArray[np.int64], top_groups: NDArray[np.int64], nodes: int) -> Array:
    """Per layer, the nodes other than its own a token's experts lie on, on average, when
    each of ``nodes`` nodes holds ``groups / nodes`` whole groups and a token's experts
    come from ``top_groups`` of them, chosen evenly: ``(n − 1)·(1 − q)``, ``q`` the chance
    that a given node holds none of the chosen groups."""
    other = groups - groups // nodes
    q = np.array(
        [
            math.comb(int(o), int(t)) / math.comb(int(n), int(t))
            for o, t, n in zip(other, top_groups, groups, strict=True)
        ]
    )
    return np.asarray((nodes - 1) * (1.0 - q))


def node_limited(experts: ExpertTable, expert: int, nodes: int) -> NDArray[np.bool_]:
    """Per layer, whether its routing is node-limited on ``nodes`` nodes: the router
    chooses groups (DeepSeek's ``topk_group`` of ``n_group``), the nodes hold whole
    groups and the same number of the group's ``expert`` ranks each."""
    if nodes < 2 or expert % nodes:
        return np.zeros(len(experts.experts), dtype=bool)
    return np.asarray(
        (experts.top_groups < experts.groups) & (experts.groups % nodes == 0) & (experts.blocks > 0)
    )


def alltoall(
    experts: ExpertTable,
    mesh: Mesh,
    link: GroupLink,
    like: Array,
    nodes: int = 1,
    intra: GroupLink | None = None,
) -> dict[str, Array]:
    """Seconds of the all-to-alls per forward (``ep_forward``) and backward
    (``ep_backward``) of each layer at each measured size (shaped as ``like``), the
    expert-parallel group spanning ``nodes`` nodes whose inside link is ``intra``."""
    e = mesh.expert
    if e == 1:
        zeros = np.zeros_like(like)
        return {"ep_forward": zeros, "ep_backward": zeros}
    rep = mesh.tensor if mesh.sequence_parallel else 1
    copies = experts.counts["dispatch_bytes"] / (mesh.context * rep)
    volume = 2.0 * (e - 1) / e * copies
    messages = 2.0 * experts.blocks[:, None] * np.ones_like(like)
    seconds = np.where(messages > 0, link.seconds(volume, messages), 0.0)
    limited = node_limited(experts, e, nodes)
    if intra is not None and limited.any():
        # Each token crosses to each other node its experts lie on once, and that node
        # forwards it to the ranks holding them; the two run at once (DeepSeek's kernels).
        rows = copies / np.maximum(experts.top_k, 1)[:, None]
        crossing = 2.0 * remote_nodes(experts.groups, experts.top_groups, nodes)[:, None] * rows
        members = e // nodes
        inside = 2.0 * (members - 1) / members * copies
        split = np.maximum(link.seconds(crossing, messages), intra.seconds(inside, messages))
        seconds = np.where(limited[:, None] & (messages > 0), split, seconds)
    return {"ep_forward": seconds, "ep_backward": seconds}


def exchanged(
    params: Array, experts: Array, shard_over: int, expert_replicas: int
) -> tuple[Array, Array]:
    """Bytes whose ZeRO-2/3 exchange over ``shard_over`` devices takes as long as one
    unit's (the dense part over ``S``, the experts' over ``S_x`` devices), and the ring
    steps of its two exchanges (``S − 1`` and ``S_x − 1``)."""
    dense = params - experts
    steps = np.where(dense > 0, shard_over - 1.0, 0.0)
    steps = steps + np.where(experts > 0, max(expert_replicas - 1.0, 0.0), 0.0)
    if shard_over < 2:
        return params, steps
    rate = (expert_replicas - 1) / expert_replicas / ((shard_over - 1) / shard_over)
    return np.asarray(dense + experts * rate), np.asarray(steps)
