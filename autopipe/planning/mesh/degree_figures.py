"""What one device of a stage's tensor × context group sees of each layer.

From a profile's lines (:class:`autopipe.planning.model.layer_costs.ProfileLines`), its
shard counts (:class:`autopipe.planning.mesh.shard_table.ShardTable`), a
:class:`autopipe.planning.model.mesh.Mesh`, the replicas ``D`` and the groups' links, the
lines of one device, which the cost model reads as it reads a profile's:

- **Compute.** Of a layer's FLOPs and traffic, the sharded part divides by ``t``, the rest
  is replicated (divided by ``t`` too under sequence parallelism), and every token-wise
  figure divides by ``c``. Estimated profiles re-run their roofline on the divided counts
  (float8 ones price the divided attention FLOPs at the bfloat16 peak);
  measured ones split each time by the FLOP share of the sharded part (a measured time
  does not say which of its operations took it).
- **Tensor-parallel collectives**, exposed (Megatron without communication overlap): per
  pass one ring all-reduce of the layer's ``reduce_forward`` (backward:
  ``reduce_backward``) bytes over ``c``, ``2(t−1)/t · bytes / bandwidth`` plus the link's
  latency per collective (``reductions`` of them). Sequence parallelism runs the same
  bytes as a reduce-scatter and an all-gather, in the same time.
- **Context-parallel ring**: per pass ``(c−1)/c · kv_bytes`` (twice that backward) of the
  device's key/value heads (``1/t`` of them, one whole head per device when there are
  fewer than ``t``), overlapped with the layer's attention (its FLOP share of the pass):
  only what outlasts it is exposed.
- **Routed experts** under expert parallelism ``e``: their part of each figure taken out
  of the sharded one and counted at the straggler's share, their parameters divided by
  ``e``, and the all-to-alls exposed per pass (:mod:`autopipe.planning.mesh.expert_figures`).
- **ZeRO-2/3** over ``S = D·c`` devices: each unit's exchange, exposed per stage beside
  the compute of the stage's own units (:mod:`autopipe.planning.mesh.zero_exchange`).
- **Memory.** Sharded saved bytes and parameters divide by ``t``; ``replicated_saved``
  too under sequence parallelism; saved, output and input bytes divide by ``c``; the
  boundary sent to the next stage by ``t`` too under sequence parallelism; transient
  peaks and the bytes shared with the previous layer by the layer's saved ratio.

Communication is added after the calibration's scales, which describe compute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.mesh.expert_figures import alltoall, exchanged, expert_refusal, expert_view
from autopipe.planning.mesh.mesh_links import GroupLink
from autopipe.planning.mesh.shard_table import ShardTable
from autopipe.planning.mesh.zero_exchange import StageExchanges, unit_exchange
from autopipe.planning.model.layer_costs import LayerCosts, ProfileLines
from autopipe.planning.model.mesh import Mesh
from profiler import Profile, segments

__all__: list[str] = []

Array = NDArray[np.float64]
# The exposed communication a layer's pass adds, by kind (the report names them); with
# routed experts also ``ep_forward`` and ``ep_backward``, the all-to-alls.
PARTS = ("tp_forward", "tp_backward", "cp_forward", "cp_backward")


@dataclass(frozen=True)
class GroupLinks:
    """The links of a device's tensor-parallel, context-parallel and data-parallel groups,
    and of its expert-parallel group (``None``: the data-parallel group's), with the nodes
    that group spans and the link inside a node (``None``: one node)."""

    tensor: GroupLink
    context: GroupLink
    data: GroupLink
    expert: GroupLink | None = None
    expert_nodes: int = 1
    intra: GroupLink | None = None

    @classmethod
    def uniform(cls, link: GroupLink) -> GroupLinks:
        """Every group on one link (what a profile's calibration knows: its all-reduce)."""
        return cls(link, link, link)


def _share(part: Array, total: Array) -> Array:
    """``part / total``, within [0, 1], 0 where nothing was counted."""
    safe = np.where(total > 0, total, 1.0)
    return np.where(total > 0, np.clip(part / safe, 0.0, 1.0), 0.0)


@dataclass(frozen=True)
class MeshLines:
    """One device's lines: compute and memory in ``lines``, the exposed tensor- and
    context-parallel collectives by kind in ``parts`` (seconds per layer and measured size,
    :data:`PARTS`), under ZeRO-2/3 each unit's exchange (``units``, seconds; exposed per
    stage, :mod:`autopipe.planning.mesh.zero_exchange`), and under ZeRO-3 the bytes of the
    gathered units in flight while each layer runs (``gathered``)."""

    lines: ProfileLines
    parts: dict[str, Array]
    mesh: Mesh
    gathered: Array
    units: Array | None = None

    def part(self, name: str, micro_batch: float) -> Array:
        """One kind of exposed communication of every layer at ``micro_batch`` samples."""
        a, b = segments(self.lines.sizes, self.parts[name], micro_batch)
        return np.maximum(a + b * micro_batch, 0.0)

    def at(self, micro_batch: float, time_batch: float | None = None) -> LayerCosts:
        """The layer costs at ``micro_batch`` samples (times at ``time_batch``)."""
        costs = self.lines.at(micro_batch, time_batch)
        when = micro_batch if time_batch is None else time_batch
        p = {name: self.part(name, when) for name in self.parts}
        exposure = None
        if self.units is not None:  # beside the compute of the stage's other units
            exposure = StageExchanges(self.mesh.zero, self.units, costs.forward, costs.backward)
        forward = costs.forward + p["tp_forward"] + p["cp_forward"]
        backward = costs.backward + p["tp_backward"] + p["cp_backward"]
        bwd_input = costs.backward_input
        if bwd_input is not None:  # the input's gradients carry the collectives
            bwd_input = bwd_input + p["tp_backward"] + p["cp_backward"]
        alltoall: tuple[Array | None, Array | None] = (None, None)
        if "ep_forward" in p:  # the all-to-alls, charged whole (DualPipeV's pairs hide some)
            forward, backward = forward + p["ep_forward"], backward + p["ep_backward"]
            if bwd_input is not None:
                bwd_input = bwd_input + p["ep_backward"]
            alltoall = (p["ep_forward"], p["ep_backward"])
        if bwd_input is not None:
            bwd_input = np.minimum(bwd_input, backward)
        return dataclasses.replace(
            costs,
            forward=forward,
            backward=backward,
            backward_input=bwd_input,
            peak=costs.peak + self.gathered,
            exposure=exposure,
            alltoall_forward=alltoall[0],
            alltoall_backward=alltoall[1],
        )


def mesh_lines(
    lines: ProfileLines, table: ShardTable, mesh: Mesh, links: GroupLinks, replicas: int
) -> MeshLines:
    """The lines one device of ``mesh`` sees (see the module docstring).

    Raises:
        ValueError: the mesh cannot run the profile (:meth:`ShardTable.refusal`).
    """
    refused = table.refusal(mesh) or expert_refusal(table.experts, mesh, replicas)
    if refused:
        raise ValueError(refused)
    experts = table.experts
    if experts is not None:  # the routed experts' own division, then the usual one
        lines, table = expert_view(lines, table, experts, mesh)
    t, c, sp = mesh.tensor, mesh.context, mesh.sequence_parallel
    rep = t if sp else 1
    sh, cnt, values = table.shards, table.counts, lines.values

    def divided(total: Array, sharded: Array) -> Array:
        return (np.maximum(total - sharded, 0.0) / rep + sharded / t) / c

    def scaled(time: Array, total: Array, sharded: Array) -> Array:
        s = _share(sharded, total)
        return time * ((1.0 - s) / rep + s / t) / c

    roof = table.roofline
    if roof is not None:
        # Attention is sharded by heads (1/t) and by tokens (1/c); float8 estimates price
        # it at the bfloat16 peak, the rest at the float8 one.
        attention = sh["attention_flops"] / (t * c)
        attention_bwd = sh["attention_backward_flops"] / (t * c)
        forward = roof.seconds(
            divided(cnt["flops"], sh["flops"]), divided(cnt["traffic"], sh["traffic"]), attention
        )
        bwd_traffic = divided(cnt["backward_traffic"], sh["backward_traffic"])
        backward = roof.seconds(
            divided(cnt["backward_flops"], sh["backward_flops"]), bwd_traffic, attention_bwd
        )
        share = np.where(
            cnt["backward_flops"] > 0,
            _share(cnt["backward_input_flops"], cnt["backward_flops"]),
            1.0,
        )
        bwd_input = np.minimum(
            roof.seconds(
                divided(cnt["backward_input_flops"], sh["backward_input_flops"]),
                bwd_traffic * share,
                attention_bwd,
            ),
            backward,
        )
    else:
        forward = scaled(values["forward"], cnt["flops"], sh["flops"])
        backward = scaled(values["backward"], cnt["backward_flops"], sh["backward_flops"])
        bwd_input = scaled(
            values["backward_input"], cnt["backward_input_flops"], sh["backward_input_flops"]
        )
    parts = _collectives(table, mesh, links, forward, backward)
    if experts is not None:
        link = links.expert or links.data
        nodes = links.expert_nodes if links.intra is not None else 1
        parts.update(alltoall(experts, mesh, link, forward, nodes, links.intra))
    params = lines.params - table.sharded_params + table.sharded_params / t
    shard_over = replicas * c
    units = None
    if mesh.zero >= 2 and shard_over >= 2 and len(params):
        moved, steps = params, None
        if lines.experts is not None:  # the experts' exchange runs over S_x devices
            moved, steps = exchanged(
                params, lines.experts, shard_over, mesh.expert_replicas(replicas)
            )
        units = unit_exchange(moved, shard_over, links.data, steps)
    saved_rep = np.maximum(
        values["saved"] - sh["saved"] - (sh["replicated_saved"] if sp else 0.0), 0.0
    )
    saved = (saved_rep + sh["saved"] / t + (sh["replicated_saved"] / t if sp else 0.0)) / c
    ratio = np.where(values["saved"] > 0, _share(saved, values["saved"]), 1.0 / c)
    new_values = dict(values)
    new_values.update(
        forward=forward,
        backward=backward,
        backward_input=bwd_input,
        saved=saved,
        shared=values["shared"] * ratio,
        peak=values["peak"] * ratio,
        output=values["output"] / (c * rep),
    )
    if "rebuilt" in values:  # re-computed norms' outputs: replicated activations
        new_values["rebuilt"] = values["rebuilt"] / (rep * c)
    tied = tuple(
        dataclasses.replace(
            item,
            bytes=int(item.bytes * _share(params[item.layers[0]], lines.params[item.layers[0]]))
            if lines.params[item.layers[0]] > 0 and not item.buffer
            else item.bytes,
        )
        for item in lines.tied
    )
    own = dataclasses.replace(
        lines, values=new_values, input=lines.input / c, params=params, tied=tied
    )
    return MeshLines(own, parts, mesh, gathered_units(mesh.zero, params, shard_over), units)


def gathered_units(zero: int, params: Array, shard_over: int) -> Array:
    """Bytes ZeRO-3 holds beyond a device's shard while each layer runs: the layer's
    parameters gathered whole and, backward, its gradients before their reduce-scatter,
    and the neighbouring unit prefetched (the larger of the two)."""
    if zero < 3 or shard_over < 2 or not len(params):
        return np.zeros_like(params)
    neighbours = np.maximum(
        np.concatenate([[0.0], params[:-1]]), np.concatenate([params[1:], [0.0]])
    )
    return np.asarray(2.0 * params + neighbours)


def _collectives(
    table: ShardTable, mesh: Mesh, links: GroupLinks, forward: Array, backward: Array
) -> dict[str, Array]:
    """The tensor-parallel all-reduces and the exposed context-parallel ring, per pass."""
    t, c = mesh.tensor, mesh.context
    sh, cnt = table.shards, table.counts
    zeros = np.zeros_like(forward)
    out = {name: zeros for name in PARTS}
    messages = table.reductions[:, None] * np.ones_like(forward)
    if t > 1:
        ring = 2.0 * (t - 1) / t
        out["tp_forward"] = links.tensor.seconds(ring * sh["reduce_forward"] / c, messages)
        out["tp_backward"] = links.tensor.seconds(ring * sh["reduce_backward"] / c, messages)
        out["tp_forward"] = np.where(messages > 0, out["tp_forward"], 0.0)
        out["tp_backward"] = np.where(messages > 0, out["tp_backward"], 0.0)
    if c > 1:
        kv = table.kv_heads[:, None]
        holders = np.where(kv > 0, np.minimum(t, np.maximum(kv, 1)), t)
        volume = (c - 1) / c * sh["kv_bytes"] / holders
        steps = (c - 1) * table.attention_calls[:, None] * np.ones_like(forward)
        ring_forward = np.where(steps > 0, links.context.seconds(volume, steps), 0.0)
        ring_backward = 2.0 * ring_forward
        attention = forward * _share(sh["attention_flops"], cnt["flops"])
        attention_bwd = backward * _share(sh["attention_backward_flops"], cnt["backward_flops"])
        out["cp_forward"] = np.maximum(ring_forward - attention, 0.0)
        out["cp_backward"] = np.maximum(ring_backward - attention_bwd, 0.0)
    return out


def uniform_mesh_lines(
    profile: Profile, lines: ProfileLines, mesh: Mesh, replicas: int, bandwidth: float | None
) -> MeshLines:
    """:func:`mesh_lines` of the profile's own shard counts with every group on one link of
    ``bandwidth`` bytes/s (``None``: free), as :func:`autopipe.search` prices a mesh
    without a target's links: what :func:`autopipe.plan` prices ``tensor_parallel`` with.

    Raises:
        ValueError: the mesh cannot run the profile (no shard counts, heads ``t`` does not
            divide).
    """
    table = ShardTable.from_profile(profile)
    return mesh_lines(lines, table, mesh, GroupLinks.uniform(GroupLink(bandwidth)), replicas)
