"""Planning with the norms re-computed: the figures, the plans and the search."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from autopipe import Plan, plan, search
from autopipe.planning.recomputed_norms import recomputed_norms
from profiler import Profile, profile_model

H = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _profile() -> Profile:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(4)))
    # Counted at the micro-batch the plans run (2 rows of 10 tokens).
    return profile_model(model, torch.randn(8, 10, H), measure=False, batch_sizes=[2])


def test_the_norms_outputs_leave_the_saved_bytes_and_their_work_joins_the_backward() -> None:
    profile = _profile()
    changed = recomputed_norms(profile)
    for before, after in zip(profile.layers, changed.layers, strict=True):
        assert before.norm_saved is not None and before.norm_saved[0] > 0
        assert after.saved == [before.saved[0] - before.norm_saved[0]]
        assert before.backward_flops is not None and before.norm_flops is not None
        assert after.backward_flops == [before.backward_flops[0] + before.norm_flops[0]]
        assert before.backward_traffic is not None and before.norm_traffic is not None
        assert after.backward_traffic == [before.backward_traffic[0] + before.norm_traffic[0]]
        assert after.forward == before.forward and after.flops == before.flops
        assert after.norm_saved is None and after.norm_traffic is None  # re-computed already
    with pytest.raises(ValueError, match="or after they were re-computed"):
        recomputed_norms(changed)


def test_a_profile_without_norm_counts_is_refused_with_what_to_do() -> None:
    profile = _profile()
    older = dataclasses.replace(
        profile, layers=[dataclasses.replace(x, norm_saved=None) for x in profile.layers]
    )
    with pytest.raises(ValueError, match="profile the model again"):
        plan(older, 2, recompute_norms=True)


def test_a_model_without_norms_is_told_it_has_none_to_recompute() -> None:
    found = profile_model(
        nn.Sequential(nn.Linear(H, H), nn.ReLU()), torch.randn(8, H), measure=False
    )
    with pytest.raises(ValueError, match="there are no norms to re-compute"):
        plan(found, 2, recompute_norms=True)


def test_a_plan_holds_less_by_the_norms_outputs_of_its_micro_batches_in_flight() -> None:
    profile = _profile()
    kept = plan(profile, 2, checkpoint="never", chunks=4, batch=8)
    freed = plan(profile, 2, checkpoint="never", chunks=4, batch=8, recompute_norms=True)
    assert freed.recompute_norms and not kept.recompute_norms
    assert freed.balance == kept.balance
    for a, b in zip(kept.stages, freed.stages, strict=True):
        norms = sum(profile.layers[i].norm_saved[0] for i in range(a.start, a.stop))  # type: ignore[index]
        # GPipe's fill-drain holds all four micro-batches at the peak.
        assert a.activation_memory - b.activation_memory == pytest.approx(4 * norms)
    again = Plan.from_dict(freed.to_dict())
    assert again.recompute_norms


def test_the_search_plans_with_the_norms_recomputed() -> None:
    plans = search(_profile(), 2, checkpoints=("never",), recompute_norms=True, top=3)
    assert plans and all(p.recompute_norms for p in plans)


def test_the_runners_refuse_a_plan_recomputing_the_norms() -> None:
    freed = plan(_profile(), 2, checkpoint="never", recompute_norms=True)
    for runner in ("GPipe", "DistributedPipeline"):
        with pytest.raises(ValueError, match=f"which {runner} does not run"):
            freed.check_runnable(runner)
    from autopipe import GPipe

    with pytest.raises(ValueError, match="re-computes the norms alone"):
        GPipe.from_plan(nn.Sequential(*(Block() for _ in range(4))), freed)


def test_schedules_splitting_the_backward_are_not_priced_with_the_norms_recomputed() -> None:
    profile = _profile()
    with pytest.raises(ValueError, match="zb split it"):
        plan(profile, 2, schedule="zb", chunks=4, batch=8, recompute_norms=True)
    plans = search(profile, 2, schedules=("1f1b", "zbv", "dualpipev"), recompute_norms=True, top=20)
    assert plans and {p.schedule for p in plans} == {"1f1b"}
    with pytest.raises(ValueError, match="use gpipe or 1f1b"):
        search(profile, 2, schedules=("dualpipev",), recompute_norms=True)


def test_the_search_weighs_both_ways_of_the_norms_when_asked() -> None:
    counted = _profile()
    # Times of their own: re-computing the norms then costs backward time.
    profile = dataclasses.replace(
        counted,
        layers=[
            dataclasses.replace(x, forward=[1e-3], backward=[2e-3], backward_input=[1e-3])
            for x in counted.layers
        ],
    )
    both = search(
        profile, 2, checkpoints=("never",), schedules=("gpipe",), recompute_norms=(False, True),
        top=20,
    )  # fmt: skip
    assert {p.recompute_norms for p in both} == {False, True}
    assert not both[0].recompute_norms  # no cap: keeping them is faster
    assert any(n.startswith("best of") for n in both[0].notes)
    assert "weighed with the norms' outputs kept and re-computed" in both[0].notes
    assert all(p.throughput <= both[0].throughput for p in both)
    slower = next(p for p in both if p.recompute_norms)  # its own search's best
    assert len(slower.notes) == 1 and "the best step" in slower.notes[0]
    with pytest.raises(ValueError, match="lists the ways"):
        search(profile, 2, recompute_norms=())
