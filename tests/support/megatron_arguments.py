"""Megatron-LM's command line as its parser reads it, for the tests of the megatron export.

megatron-core 0.16.1 ships Megatron's config dataclasses but not Megatron-LM's
``megatron/training/arguments.py``. This parser follows that file (NVIDIA/Megatron-LM at
d98e8a6): the flags it makes from ``TransformerConfig`` fields are made here the same
way from megatron-core's own fields (``--name-with-dashes``, the field's type, a
``Literal``'s choices, ``store_true`` for a flag of default false); the flags it adds
by hand carry the names, types and choices written there.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import types
import typing
from typing import Any

# TransformerConfig fields Megatron-LM turns into flags (its ArgumentGroupFactory).
CONFIG_FLAGS = (
    "num_layers",
    "tensor_model_parallel_size",
    "sequence_parallel",
    "context_parallel_size",
    "pipeline_model_parallel_size",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
)
# The flags arguments.py adds by hand, and the TransformerConfig field each sets.
SPLIT_FIELDS = {
    "pipeline_model_parallel_layout": "pipeline_model_parallel_layout",
    "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}


def _field_kwargs(annotation: Any, default: Any) -> dict[str, Any]:
    """argparse's settings for a dataclass field, as Megatron-LM's factory infers them."""
    origin, inner = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union) and inner[-1] is type(None):
        return _field_kwargs(inner[0], default)
    if origin is typing.Literal:
        return {"type": type(inner[0]), "choices": inner, "default": default}
    if annotation is bool:
        assert default is False  # the flags the export writes switch something on
        return {"action": "store_true"}
    return {"type": annotation, "default": default}


def megatron_parser() -> argparse.ArgumentParser:
    """A parser of the Megatron-LM flags the megatron export writes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", exit_on_error=False)
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    hints = typing.get_type_hints(TransformerConfig)
    for name in CONFIG_FLAGS:
        kwargs = _field_kwargs(hints[name], fields[name].default)
        parser.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)
    parser.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--use-megatron-fsdp", action="store_true")
    parser.add_argument(
        "--data-parallel-sharding-strategy",
        type=str,
        default="optim_grads_params",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    parser.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
    )
    parser.add_argument("--recompute-modules", nargs="*", type=str, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None)
    return parser


def command_lines(text: str) -> list[argparse.Namespace]:
    """Each command line of a megatron export, parsed; a flag Megatron lacks fails."""
    parser = megatron_parser()
    return [
        parser.parse_args(shlex.split(line)) for line in text.splitlines() if line.startswith("--")
    ]


def transformer_config(arguments: argparse.Namespace, **model: Any) -> Any:
    """megatron-core's ``TransformerConfig`` of the parsed flags (its own checks run), the
    model's own settings ``model`` added (the export writes none of them)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = vars(arguments)
    config = {name: values[name] for name in CONFIG_FLAGS}
    if values["recompute_modules"] is not None:
        config["recompute_modules"] = values["recompute_modules"]
    config |= {
        field: values[flag] for flag, field in SPLIT_FIELDS.items() if values[flag] is not None
    }
    tensor = config["tensor_model_parallel_size"]
    return TransformerConfig(
        hidden_size=8 * tensor,
        num_attention_heads=tensor,  # heads divide over the tensor-parallel group
        pipeline_dtype=torch.float32,
        **config,
        **model,
    )


def data_parallel_config(arguments: argparse.Namespace) -> Any:
    """megatron-core's ``DistributedDataParallelConfig`` of the parsed flags."""
    from megatron.core.distributed import DistributedDataParallelConfig

    strategy = (
        arguments.data_parallel_sharding_strategy if arguments.use_megatron_fsdp else "no_shard"
    )
    return DistributedDataParallelConfig(
        use_distributed_optimizer=arguments.use_distributed_optimizer,
        use_megatron_fsdp=arguments.use_megatron_fsdp,
        data_parallel_sharding_strategy=strategy,
    )


# The mixture-of-experts flags the export writes: TransformerConfig fields whose flags
# carry the field's name (arguments.py adds --expert-model-parallel-size and
# --expert-tensor-parallel-size by hand under those names, with these types), and
# --num-experts, which arguments.py adds by hand for the field num_moe_experts.
MOE_FLAGS = ("moe_router_topk", "expert_model_parallel_size", "expert_tensor_parallel_size")


def moe_command_lines(text: str) -> list[argparse.Namespace]:
    """:func:`command_lines` with Megatron-LM's mixture-of-experts flags too."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    parser = megatron_parser()
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    hints = typing.get_type_hints(TransformerConfig)
    for name in MOE_FLAGS:
        kwargs = _field_kwargs(hints[name], fields[name].default)
        parser.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)
    parser.add_argument("--num-experts", type=int, default=None)
    return [
        parser.parse_args(shlex.split(line)) for line in text.splitlines() if line.startswith("--")
    ]


def moe_transformer_config(arguments: argparse.Namespace) -> Any:
    """:func:`transformer_config` with the routed experts (megatron-core checks them with
    the mesh: sequence parallelism under tensor parallelism, the experts' degrees)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = vars(arguments)
    config = {name: values[name] for name in (*CONFIG_FLAGS, *MOE_FLAGS)}
    config |= {
        field: values[flag] for flag, field in SPLIT_FIELDS.items() if values[flag] is not None
    }
    tensor = config["tensor_model_parallel_size"]
    return TransformerConfig(
        hidden_size=8 * tensor,
        num_attention_heads=tensor,
        pipeline_dtype=torch.float32,
        num_moe_experts=arguments.num_experts,
        **config,
    )
