"""What a mesh search's plans report of expert parallelism: the all-to-alls' seconds per
step and, for a runner-up that loses by them, why in one line."""

from __future__ import annotations

import re

from autopipe.planning import SearchOptions, search
from autopipe.planning.mesh.mesh_links import GroupLink, MeshLinks
from tests.support.mesh_profiles import block_profile, moe_profile

LINK = GroupLink(64.0, 0.5)
OPTIONS = SearchOptions(
    schedules=("gpipe",),
    checkpoints=("never",),
    top=100,
    micro_batch=1,
    links=MeshLinks.uniform(LINK),
    expert_parallel=(1, 4),
)


def test_a_runner_up_names_the_all_to_alls_it_loses_by() -> None:
    plans = search(moe_profile(4, batch=8), 8, optimizer="adam", options=OPTIONS)
    assert plans[0].mesh.expert == 1 and "expert" not in plans[0].mesh_parts
    (one_stage,) = [p for p in plans if p.mesh.expert == 4 and p.num_stages == 1]
    # 4 layers, each pass 2 · 3/4 · 128 B / 64 B/s + 2 · 0.5 s, forward and backward, of
    # the one micro-batch of each of the 8 replicas.
    assert one_stage.mesh_parts == {"expert": 4 * (4.0 + 4.0)}
    share = round(100 * 32.0 / one_stage.step_time)
    note = one_stage.notes[0]
    assert re.fullmatch(
        rf"EP=4: 2 all-to-alls per MoE block pass over 6\.4e-08 GB/s, {share}% of the step",
        note,
    ), note
    # The table's mesh column and its bottleneck name the all-to-alls too.
    from autopipe.output import render_search

    table = render_search(plans)
    assert "TP=1 CP=1 EP=4 PP=1 DP=8 ZeRO-0" in table
    assert "EP=4: 2 all-to-alls per MoE block pass" in table


def test_a_dense_search_weighs_no_expert_degree() -> None:
    options = SearchOptions(
        schedules=("gpipe",), checkpoints=("never",), top=100, micro_batch=1,
        links=MeshLinks.uniform(LINK),
    )  # fmt: skip
    plans = search(block_profile(4, batch=8), 8, optimizer="adam", options=options)
    assert plans and all(p.mesh.expert == 1 and "expert" not in p.mesh_parts for p in plans)
    assert all("expert" not in p.to_dict().get("mesh", {}) for p in plans)
