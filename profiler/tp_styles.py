"""The tensor-parallel styles the counting knows (Hugging Face's plan names), and what each
shards: which of a styled module's parameters are split over the tensor group, and which
styles make a column-wise, row-wise or vocabulary-sharded product."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SHARD_STYLES"]

# Each style the counting knows, with what it does (the names of Hugging Face's plans).
SHARD_STYLES: dict[str, str] = {
    "colwise": "column-wise: weight and bias sharded on the output features",
    "packed_colwise": "column-wise on a packed weight (gate and up in one)",
    "colwise_rep": "column-wise, the output all-gathered",
    "colwise_gather_output": "column-wise, the output all-gathered",
    "rowwise": "row-wise: weight sharded on the input features, the output all-reduced",
    "packed_rowwise": "row-wise on a packed weight",
    "rowwise_rep": "row-wise on a replicated input (split locally), the output all-reduced",
    "rowwise_split_input": "row-wise on a replicated input (split locally)",
    "embedding_rowwise": "embedding sharded on the vocabulary, the output all-reduced",
    "local_colwise": "column-wise, no collective",
    "local_rowwise": "row-wise, the output left partial for a later gather",
    "local": "every parameter sharded, no collective",
    "sequence_parallel": "replicated parameters on sequence-sharded activations",
    "replicate": "replicated",
    # DeepSeek's latent attention: kv_a_proj_with_mqa stays whole on every device (its
    # rotary part's small gradient all-reduce is not counted).
    "mla_kv_a_proj": "replicated (multi-head latent attention's key/value down-projection)",
    "gather": "replicated parameters; a partial output is all-reduced where it is used",
}

COLUMN = {"colwise", "packed_colwise", "colwise_rep", "colwise_gather_output", "local_colwise"}
ROW = {"rowwise", "packed_rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise"}
GATHERED = {"colwise_rep", "colwise_gather_output"}
EMBEDDING = {"embedding_rowwise"}


def check_styles(styles: Mapping[str, str], where: str) -> None:
    """Refuses a style the counting does not know, in one line naming it."""
    for name, style in styles.items():
        if style not in SHARD_STYLES:
            raise ValueError(
                f"unknown tensor-parallel style {style!r} for {name} of {where}; use one of "
                + ", ".join(SHARD_STYLES)
            )


def sharded_roles(style: str, name: str) -> bool:
    """Whether a parameter (``name`` in its module) of a module of ``style`` is sharded."""
    if style in COLUMN or style in EMBEDDING or style == "local":
        return True
    if style in ROW:
        return not name.rsplit(".", 1)[-1].startswith("bias")  # added after the reduction
    return False
