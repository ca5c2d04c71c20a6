"""Tests of ``autopipe plan`` (autopipe.cli.plan_command)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autopipe
from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import default_chunks, evaluate
from profiler.profile import Profile
from tests.support.cli_support import (
    FAST,
    MLP,
    RESIDUAL_MODEL,
    ROOT,
    SMALL_MODEL,
    assert_error,
    run,
)
from tests.support.cnn_models import write_squeeze_cnn


def test_plan_example(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", MLP, *FAST, "--json", str(out_file))
    assert code == 0, err
    result = Plan.load(out_file)
    assert sum(result.balance) == 16 and len(result.balance) == 2
    assert result.chunks == 8 and result.micro_batch == 4  # 4 x stages by default
    assert f"balance     {result.balance}" in out
    assert "16 layers on 2 stages" in out
    assert "(embed.." in out and "..head)" in out
    assert "uniform [8, 8]" in out
    profile = Profile.from_dict(result.profile)
    uniform = evaluate(profile, [8, 8], chunks=result.chunks)
    assert result.step_time <= uniform.step_time * (1 + 1e-9)
    assert "plan written to" in err and "Traceback" not in err


def test_plan_hugging_face_example(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out_file = tmp_path / "plan.json"
    example = str(ROOT / "examples" / "gpt2.py")
    argv = ["plan", example, *FAST, "--stages", "4", "--chunks", "4", "--json", str(out_file)]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "17 layers on 4 stages" in out and "..lm_head)" in out
    # GPT-2's default config ties its head to the token embedding: a copy on both ends.
    assert "tied        transformer.wte.weight = lm_head.weight on stages 0, 3 (8.00 MiB" in out
    result = Plan.load(out_file)
    # Traced and cut between blocks: embeddings, 12 blocks, final norm, LM head.
    assert len(result.balance) == 4 and sum(result.balance) >= 14
    assert result.stages[-1].layers[-1] == "lm_head"
    # Units are named by their modules' dotted names, as named_modules() gives them.
    blocks = [name for stage in result.stages for name in stage.layers if ".h." in name]
    assert len(blocks) == 12
    assert "Traceback" not in err


DEBERTA_MODEL = """from tests.support.hf_models import deberta_v2

model, (sample,), _ = deberta_v2()
"""


def test_plan_deberta_v2_on_four_stages(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path, out_file = tmp_path / "deberta.py", tmp_path / "plan.json"
    path.write_text(DEBERTA_MODEL)
    code, out, err = run(capsys, "plan", str(path), *FAST, "--stages", "4", "--json", str(out_file))
    assert code == 0, err
    result = Plan.load(out_file)
    # Every encoder layer reads encoder.rel_embeddings.weight, and each is a unit still.
    assert [name for stage in result.stages for name in stage.layers] == [
        "embeddings",
        *(f"encoder.layer.{i}" for i in range(4)),
    ]
    readers = [s.index for s in result.stages if s.stop > 1]  # a stage with an encoder layer
    (tied,) = result.tied
    assert tied.names == ["encoder.rel_embeddings.weight"] and tied.stages == readers
    # The float32 table, 16 relative positions of 32 numbers, counted on each reader.
    assert [s.tied for s in result.stages] == [
        2048 if s.index in readers else 0 for s in result.stages
    ]
    where = ", ".join(map(str, readers))
    assert f"tied        encoder.rel_embeddings.weight on stages {where} (2.00 KiB each" in out


def test_plan_from_profile(capsys: pytest.CaptureFixture[str], profile_file: Path) -> None:
    code, out, err = run(capsys, "plan", "--profile", str(profile_file), "--stages", "3")
    assert code == 0, err
    assert "16 layers on 3 stages" in out
    assert "12 micro-batches" in out or "11 micro-batches" in out  # 4 x 3, capped by 32
    assert "uniform [6, 5, 5]" in out


def test_one_device_stages_take_turns(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    from autopipe.planning.model.plans import Plan

    out_file = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile_file), "--stages", "3", "--json", str(out_file)]
    code, out, err = run(capsys, *argv, "--one-device")
    assert code == 0, err
    assert "stages 0, 1, 2 share cpu: they run one after another" in out
    assert "the least memory per stage chose this one" in out
    found = Plan.load(out_file)
    assert found.shared == [[0, 1, 2]]
    assert found.step_time == pytest.approx(found.chunks * sum(s.time for s in found.stages))
    code, out, err = run(capsys, *argv)  # devices of their own: nothing shared
    assert code == 0, err
    assert "share cpu" not in out


def test_plan_options(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        "--profile",
        str(profile_file),
        "--stages",
        "2",
        "--chunks",
        "4",
        "--memory",
        "1GiB,2GiB",
        "--checkpoint",
        "never",
        "--schedule",
        "1f1b",
        "--optimizer",
        "sgd",
        "--bandwidth",
        "10GB/s",
        "--json",
        str(out_file),
    )
    assert code == 0, err
    result = Plan.load(out_file)
    assert result.chunks == 4 and result.checkpoint == "never" and result.schedule == "1f1b"
    assert [s.capacity for s in result.stages] == [2**30, 2**31]
    assert result.devices[0].bandwidth == 1e10
    assert "of which send" in out and "/ 1.00 GiB" in out


def test_uniform_strategy_compares_with_optimal(
    capsys: pytest.CaptureFixture[str], profile_file: Path
) -> None:
    code, out, _ = run(capsys, "plan", "--profile", str(profile_file), "--strategy", "uniform")
    assert code == 0
    assert "balance     [8, 8]" in out
    assert "optimal [" in out


def test_torchtitan_strategy_follows_torchtitans_split(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    # The MLP's units are no decoder-only model: one error line.
    argv = ["plan", "--profile", str(profile_file), "--strategy", "torchtitan"]
    assert_error(*run(capsys, *argv), "strategy 'torchtitan' needs a decoder-only model")
    # Named as torchtitan names a Llama: embedding, 14 layers, output.
    profile = Profile.load(profile_file)
    names = ["tok_embeddings", *(f"layers.{i}" for i in range(14)), "output"]
    for layer, name in zip(profile.layers, names, strict=True):
        layer.name = name
    path = tmp_path / "llama.json"
    profile.save(path)
    code, out, err = run(capsys, "plan", "--profile", str(path), "--strategy", "torchtitan")
    assert code == 0, err
    # 16 effective layers on 2 stages: 8 each, the embedding and output among them.
    assert "balance     [8, 8]" in out


def test_cuda_profile_names_stage_devices(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    profile = Profile.load(profile_file)
    profile.device = "cuda:0"
    path = tmp_path / "cuda.json"
    profile.save(path)
    out_file = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "--profile", str(path), "--json", str(out_file))
    assert code == 0
    assert [s.device for s in Plan.load(out_file).stages] == ["cuda:0", "cuda:1"]


def test_virtual_stages(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile_file), "--stages", "2", "--virtual-stages", "2"]
    argv += ["--schedule", "1f1b", "--chunks", "4", "--memory", "1GiB,2GiB"]
    code, out, err = run(capsys, *argv, "--json", str(out_file))
    assert code == 0, err
    assert "16 layers on 4 stages [cpu] on 2 devices, 2 per device (interleaved)" in out
    assert "per device (its stages together)" in out
    result = Plan.load(out_file)
    assert result.virtual_stages == 2 and result.num_devices == 2
    assert result.checkpoint == "never"  # torch's interleaved schedules keep activations
    assert [s.capacity for s in result.stages] == [2**30, 2**31, 2**30, 2**31]
    picture = tmp_path / "t.png"  # one row per device, its two stages hatched apart
    code, _, err = run(capsys, *argv, "--timeline", str(picture))
    assert code == 0, err
    assert picture.read_bytes().startswith(b"\x89PNG")
    # With --search: 1 or 2 stages per device are both configurations of the search.
    search = ["plan", "--profile", str(profile_file), "--search", "--devices", "2"]
    code, out, err = run(capsys, *search, "--virtual-stages", "2", "--top", "200")
    assert code == 0, err
    assert "interleaved 1f1b, 2 stages per device" in out and "looped bfs" in out
    assert "interleaved by replayed schedules" in out


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path, schedule: str
) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile_file), "--stages", "2", "--schedule", schedule]
    argv += ["--chunks", "4", "--memory", "1GiB,2GiB"]
    code, out, err = run(capsys, *argv, "--json", str(out_file))
    assert code == 0, err
    result = Plan.load(out_file)
    assert (result.schedule, result.virtual_stages, result.num_stages) == (schedule, 2, 4)
    # Device 0 holds stages 0 and 3, device 1 stages 1 and 2.
    assert [s.capacity for s in result.stages] == [2**30, 2**31, 2**31, 2**30]
    code, _, err = run(capsys, *argv, "--virtual-stages", "3")
    assert code == 2 and "runs 2 stages per device" in err
    search = ["plan", "--profile", str(profile_file), "--search", "--devices", "2"]
    code, out, err = run(capsys, *search, "--schedule", schedule, "--top", "5")
    assert code == 0, err
    assert schedule in out


def test_wrap_defaults_to_the_command_lines_chunks() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    wrapped = autopipe.wrap(model, torch.randn(32, 4), stages=2)
    try:
        assert wrapped.plan.chunks == default_chunks(2, 32) == 8
    finally:
        wrapped.close()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--memory", "16XB"], "cannot parse memory size '16XB'"),
        (["--memory", "1GB,2GB,3GB"], "--memory lists 3 sizes but there are 2 stages"),
        (["--memory", "1KB"], "does not fit"),
        (["--stages", "20"], "cannot split 16 layers into 20"),
        (["--bandwidth", "fast"], "cannot parse bandwidth 'fast'"),
        (["--optimizer", "lion"], "unknown optimizer 'lion'"),
        (["--one-device", "--virtual-stages", "2"], "leave out --virtual-stages"),
        (["--tensor-parallel", "2"], "plan the mesh around the pipeline: add --search"),
        (["--zero", "1", "--micro-batch", "1"], "--zero, --micro-batch plan the mesh"),
    ],
)
def test_bad_plan_options(
    capsys: pytest.CaptureFixture[str],
    profile_file: Path,
    tmp_path: Path,
    args: list[str],
    expected: str,
) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(profile_file), *args, "--json", str(out_file)]
    assert_error(*run(capsys, *argv), expected)
    assert not out_file.exists()


def test_too_many_stages_before_profiling(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "good.py"
    path.write_text(SMALL_MODEL)
    assert_error(*run(capsys, "plan", str(path), "--stages", "4"), "use --stages 3 or fewer")


def test_plan_non_sequential_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)
    out_json = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", str(path), "--stages", "2", *FAST, "--json", str(out_json))
    assert code == 0, err
    plan = Plan.load(out_json)
    # Units: inp, blocks.0..3, out — cut along module calls.
    assert sum(plan.balance) == 6 and len(plan.balance) == 2
    # The first stage starts at inp and the last ends at out (a stage of one unit shows only
    # its name, and the measured balance may give either stage a single unit).
    assert "(inp.." in out or "(inp)" in out
    assert "..out)" in out or "(out)" in out


def test_plan_batch_and_auto(capsys: pytest.CaptureFixture[str], profile_file: Path) -> None:
    argv = ["plan", "--profile", str(profile_file), "--batch", "16", "--checkpoint", "auto"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "batch 16 as 8 micro-batches of 2" in out and "checkpoint auto (" in out
    assert_error(*run(capsys, "plan", "--profile", str(profile_file), "--devices", "4"), "--search")
    assert_error(*run(capsys, "plan", "--profile", str(profile_file), "--even"), "--search")
    argv = ["plan", "--profile", str(profile_file), "--search", "--devices", "2", "--even"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err


def test_plan_under_autocast_names_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "good.py"
    path.write_text(SMALL_MODEL)
    plan_file = tmp_path / "plan.json"
    argv = ["plan", str(path), "--autocast", "float16", "--json", str(plan_file), *FAST]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "optimizer adam, autocast float16\n" in out and "dtype" not in out
    assert Plan.load(plan_file).profile["autocast"] == "float16"
    code, out, err = run(capsys, "plan", str(path), *FAST)
    assert code == 0, err
    assert "autocast" not in out and "dtype" not in out


TIED_MODEL = """import torch
from torch import nn


class TiedEnds(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.mid1 = nn.Linear(4, 4)
        self.mid2 = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)
        self.last.weight = self.first.weight

    def forward(self, x):
        return self.last(torch.tanh(self.mid2(torch.tanh(self.mid1(self.first(x))))))


model = TiedEnds()
sample = torch.randn(8, 4)
"""

TIED_SEQUENTIAL = """import torch
from torch import nn

a, b = nn.Linear(4, 4), nn.Linear(4, 4)
b.weight = a.weight
model = nn.Sequential(a, nn.Tanh(), b)
sample = torch.randn(8, 4)
"""


def test_plan_marks_tied_parameters(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "tied.py"
    path.write_text(TIED_MODEL)
    plan_file = tmp_path / "plan.json"
    argv = ["plan", str(path), "--stages", "4", "--json", str(plan_file), *FAST]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    # The 4x4 float32 weight is used by the first and the last unit: a copy on each stage.
    line = "tied        first.weight = last.weight on stages 0, 3 (64 B each; gradients summed)\n"
    assert line in out
    result = Plan.load(plan_file)
    assert [s.tied for s in result.stages] == [64, 0, 0, 64]
    profile_file = tmp_path / "tied.profile.json"
    code, _, err = run(capsys, "profile", str(path), "-o", str(profile_file), *FAST)
    assert code == 0, err
    code, out, err = run(capsys, "plan", "--profile", str(profile_file), "--stages", "4")
    assert code == 0, err
    assert line in out
    code, out, err = run(capsys, "plan", str(path), "--stages", "1", *FAST)
    assert code == 0, err
    assert "tied        first.weight = last.weight on stage 0 (one copy, 64 B)\n" in out

    path.write_text(TIED_SEQUENTIAL)
    code, out, err = run(capsys, "plan", str(path), "--stages", "3", *FAST)
    assert code == 0, err
    assert "tied        0.weight = 2.weight on stages 0, 2 (64 B each; gradients summed)\n" in out


@pytest.mark.parametrize("target", [[], ["--target", "h100"]])
def test_plan_a_cnn_whose_batch_norm_sees_a_1x1_map(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: list[str]
) -> None:
    """Measured (or counted) at micro-batches of 1, its last BatchNorm refused them."""
    path = str(write_squeeze_cnn(tmp_path))
    out_file = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "plan", path, "--stages", "2", *FAST, *target, "--json", str(out_file)
    )
    assert code == 0, err
    result = Plan.load(out_file)
    assert result.micro_batch == 2 and result.profile["batch_sizes"] == [2, 4]
    assert "batch 8 as 4 micro-batches of 2" in out
    # Micro-batches of one would not train: refused, naming the layer and the fix.
    code, out, err = run(capsys, "plan", path, "--stages", "2", "--chunks", "8", *FAST, *target)
    assert_error(code, out, err, "layer squeeze.1 (UnitModule) refuses a micro-batch of 1")
    assert "at least 2 samples (fewer chunks" in err and "real weights" not in err


MIXTRAL_MODEL = """import torch
import transformers

config = transformers.MixtralConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=50,
)
model = transformers.MixtralForCausalLM(config).double()
sample = torch.randint(0, 50, (4, 8))
"""


def test_plan_float64_mixtral_by_following_the_advice(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "mixtral.py"
    path.write_text(MIXTRAL_MODEL)
    code, out, err = run(capsys, "plan", str(path), "--stages", "2", *FAST)
    assert_error(code, out, err, "model.set_experts_implementation('batched_mm')")
    path.write_text(MIXTRAL_MODEL + 'model.set_experts_implementation("batched_mm")\n')
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", str(path), "--stages", "2", *FAST, "--json", str(out_file))
    assert code == 0, err
    assert sum(Plan.load(out_file).balance) == 6 and "dtype float64" in out


PRE_NORM_MODEL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


model = Net()
sample = torch.randn(8, 32)
"""


def test_recompute_norms_plans_and_exports_megatrons_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "blocks.py"
    path.write_text(PRE_NORM_MODEL)
    out_file = tmp_path / "plan.json"
    argv = ["plan", str(path), *FAST, "--recompute-norms", "--checkpoint", "never"]
    code, out, err = run(capsys, *argv, "--json", str(out_file), "--export", "megatron")
    assert code == 0, err
    assert "checkpoint never + norms re-computed" in err  # the export took stdout
    assert "--recompute-granularity selective --recompute-modules layernorm" in out
    assert Plan.load(out_file).recompute_norms
    code, out, err = run(capsys, "plan", str(path), *FAST, "--recompute-norms", "auto")
    assert_error(code, out, err, "--recompute-norms auto weighs the norms kept and re-computed")
    argv = ["plan", str(path), *FAST, "--search", "--devices", "2", "--recompute-norms", "auto"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "weighed with the norms' outputs kept and re-computed" in out + err
    # The MLP example's LayerNorm is a unit by itself: its output is the head's to keep.
    code, out, err = run(
        capsys, "plan", MLP, *FAST, "--recompute-norms", "--json", str(tmp_path / "no.json")
    )
    assert_error(code, out, err, "there are no norms to re-compute")
    assert not (tmp_path / "no.json").exists()


DEEPSEEK_MODEL = """import torch
import transformers

config = transformers.DeepseekV3Config(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    vocab_size=100, max_position_embeddings=64, use_cache=False,
)
model = transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)
sample = torch.randint(0, 100, (4, 16))
"""


def test_recompute_up_proj_plans_deepseek_and_exports_megatrons_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "deepseek.py"
    path.write_text(DEEPSEEK_MODEL)
    base = ["plan", str(path), "--target", "h100", "--stages", "2", "--checkpoint", "never"]
    kept_file, freed_file = tmp_path / "kept.json", tmp_path / "freed.json"
    code, out, err = run(capsys, *base, "--json", str(kept_file))
    assert code == 0, err
    argv = [*base, "--recompute-up-proj", "--json", str(freed_file), "--export", "megatron"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "checkpoint never + up-projections re-computed" in err  # the export took stdout
    assert "--recompute-granularity selective --recompute-modules mla_up_proj" in out
    kept, freed = Plan.load(kept_file), Plan.load(freed_file)
    assert freed.recompute_up_proj and not kept.recompute_up_proj
    assert sum(s.activation_memory for s in freed.stages) < sum(
        s.activation_memory for s in kept.stages
    )
    # A model without a latent attention has no up-projections to re-compute.
    code, out, err = run(
        capsys, "plan", MLP, *FAST, "--recompute-up-proj", "--json", str(tmp_path / "no.json")
    )
    assert_error(code, out, err, "q_b_proj, kv_b_proj")
    assert not (tmp_path / "no.json").exists()


def test_weighing_the_norms_both_ways_keeps_each_runner_ups_mesh_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Runners-up of the two searches say what their mesh costs, then once why they are
    slower than the best of both."""
    pytest.importorskip("transformers")
    path = tmp_path / "deepseek.py"
    path.write_text(DEEPSEEK_MODEL)
    argv = ["plan", str(path), "--target", "h100", "--search", "--devices", "4"]
    code, out, err = run(capsys, *argv, "--recompute-up-proj", "--recompute-norms", "auto")
    assert code == 0, err
    rows = [line for line in out.splitlines() if "EP=" in line and "the best step" in line]
    assert rows, out
    for row in rows:
        assert row.count("the best step") == 1, row
        assert "2 all-to-alls per MoE block pass" in row
