"""Planning with the norms or the up-projections re-computed: the figures, the plans and
the search."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from autopipe import Plan, PlanningError, plan, search
from autopipe.planning.pipeline_settings import PipelineSettings
from autopipe.planning.recomputed_modules import planned_profile, recomputed_norms
from autopipe.planning.schedules.interleaving import rank_stages
from autopipe.planning.schedules.split_holding import split_moments
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


@pytest.mark.parametrize("schedule", ["zb", "zbv", "dualpipev"])
def test_under_split_backward_the_norms_outputs_live_from_the_input_gradient_to_the_weights(
    schedule: str,
) -> None:
    """Each micro-batch holds its saved set less the norms' outputs until its I, and all
    of it from its I until its W: the peaks of the replayed order, stage by stage and
    rank by rank."""
    profile = _profile()
    virtual = 1 if schedule == "zb" else 2
    options = {"schedule": schedule, "virtual_stages": virtual, "checkpoint": "never"}
    stages = 2 * virtual  # on two ranks
    kept = plan(profile, stages, strategy="uniform", chunks=4, batch=8, **options)
    freed = plan(
        profile, stages, strategy="uniform", chunks=4, batch=8, recompute_norms=True, **options
    )
    assert freed.balance == kept.balance and freed.recompute_norms
    norms, full = [], []
    for a, b in zip(kept.stages, freed.stages, strict=True):
        norms.append(sum(profile.layers[i].norm_saved[0] for i in range(b.start, b.stop)))  # type: ignore[index]
        full.append(a.activation_memory / a.in_flight)  # keeping all, each holds its set
    # Where every micro-batch in flight is past its I at the peak, nothing is saved.
    assert any(b.activation_memory < a.activation_memory for a, b in zip(kept.stages, freed.stages))
    for rank in range(2):
        local = rank_stages(rank, 2, virtual, schedule)
        peaks = [0.0] * virtual
        device = 0.0
        for row in split_moments(rank, 2, virtual, 4, schedule):
            held = [
                row[3 * j] * (full[k] - norms[k]) + row[3 * j + 1] * full[k]
                for j, k in enumerate(local)
            ]
            peaks = [max(p, h) for p, h in zip(peaks, held, strict=True)]
            device = max(device, sum(held))
        for j, k in enumerate(local):
            assert freed.stages[k].activation_memory == pytest.approx(peaks[j])
            assert peaks[j] <= kept.stages[k].activation_memory
        state = sum(freed.stages[k].param_memory for k in local)
        # One stage per rank: the stage's memory is the device's.
        devices = freed.device_memory or [stage.memory for stage in freed.stages]
        assert devices[rank] == pytest.approx(state + device)


def test_under_split_backward_a_capped_plan_recomputes_units_besides_the_norms() -> None:
    profile = _profile()
    options = {"schedule": "dualpipev", "virtual_stages": 2, "chunks": 4, "batch": 8}
    free = plan(profile, 4, checkpoint="never", recompute_norms=True, **options)
    assert free.device_memory is not None
    cap = int(0.9 * max(free.device_memory))
    capped = plan(profile, 4, checkpoint="auto", memory=cap, recompute_norms=True, **options)
    assert capped.device_memory is not None and max(capped.device_memory) <= cap
    assert any(stage.checkpoint != "never" for stage in capped.stages)
    with pytest.raises(PlanningError, match="more"):
        plan(profile, 4, checkpoint="never", memory=cap, recompute_norms=True, **options)


def test_the_search_weighs_split_backward_schedules_with_the_norms_recomputed() -> None:
    plans = search(
        _profile(), 2, schedules=("1f1b", "zbv", "dualpipev"), checkpoints=("never",),
        recompute_norms=True, top=20,
    )  # fmt: skip
    assert {p.schedule for p in plans} == {"1f1b", "zbv", "dualpipev"}
    assert all(p.recompute_norms for p in plans)


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


class LatentAttention(nn.Module):
    """A latent attention's up-projections and an eager attention after them, behind a
    norm: both kinds of re-computation find something."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_a_layernorm = nn.RMSNorm(4)
        self.q_b_proj, self.kv_b_proj = nn.Linear(4, H), nn.Linear(4, 2 * H)
        self.o_proj = nn.Linear(H, 4)

    def forward(self, latent: Tensor) -> Tensor:
        normed = self.kv_a_layernorm(latent)
        q = self.q_b_proj(normed)
        k, v = self.kv_b_proj(normed).chunk(2, dim=-1)
        return latent + self.o_proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


def _latent_profile() -> Profile:
    torch.manual_seed(0)
    model = nn.Sequential(*(LatentAttention() for _ in range(4)))
    return profile_model(model, torch.randn(8, 10, 4), measure=False, batch_sizes=[2])


def test_the_up_projections_outputs_leave_the_saved_bytes_apart_from_the_norms() -> None:
    profile = _latent_profile()
    settings = PipelineSettings(recompute_norms=True, recompute_up_proj=True)
    both = planned_profile(profile, settings)
    for before, after in zip(profile.layers, both.layers, strict=True):
        assert before.up_proj_saved is not None and before.norm_saved is not None
        assert before.up_proj_saved[0] == 2 * 10 * 3 * H * 4  # q, and k and v's storage
        freed = before.up_proj_saved[0] + before.norm_saved[0]
        assert after.saved == [before.saved[0] - freed]
        assert after.rebuilt == [freed]
        assert before.backward_flops is not None and before.up_proj_flops is not None
        assert before.norm_flops is not None and after.backward_flops is not None
        extra = before.up_proj_flops[0] + before.norm_flops[0]
        assert after.backward_flops == [before.backward_flops[0] + extra]
        assert after.up_proj_saved is None and after.norm_saved is None


def test_a_plan_recomputing_the_up_projections_holds_less_and_says_so() -> None:
    profile = _latent_profile()
    kept = plan(profile, 2, checkpoint="never", chunks=4, batch=8)
    freed = plan(profile, 2, checkpoint="never", chunks=4, batch=8, recompute_up_proj=True)
    assert freed.recompute_up_proj and not freed.recompute_norms
    assert Plan.from_dict(freed.to_dict()).recompute_up_proj
    for a, b in zip(kept.stages, freed.stages, strict=True):
        ups = sum(profile.layers[i].up_proj_saved[0] for i in range(a.start, a.stop))  # type: ignore[index]
        assert a.activation_memory - b.activation_memory == pytest.approx(4 * ups)
    with pytest.raises(ValueError, match="re-computes the attention's up-projections alone"):
        freed.check_runnable("GPipe")
    found = search(profile, 2, recompute_up_proj=True, batch=8)
    assert all(p.recompute_up_proj for p in found)


def test_a_model_without_up_projections_is_told_it_has_none_to_recompute() -> None:
    with pytest.raises(ValueError, match="q_b_proj, kv_b_proj"):
        plan(_profile(), 2, recompute_up_proj=True)
