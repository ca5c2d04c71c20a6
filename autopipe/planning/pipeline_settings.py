"""``PipelineSettings``: how a pipeline is planned, built and run, defaults decided once.

:func:`autopipe.plan`, :func:`autopipe.wrap`, :class:`autopipe.distributed.DistributedPipeline`
and the command line all take one of these (``settings=``) and the keywords of its fields,
which :func:`with_overrides` lays over it. The defaults that depend on the run (the
micro-batch count, the schedule, the checkpoint mode) are left ``None`` here and decided by
:meth:`PipelineSettings.resolved` alone, so that every entry point picks the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PLAN_FIELDS", "PipelineSettings", "with_overrides"]

MemorySpec = int | str | Sequence[int | str | None] | None

# GPipe's rule of thumb: M >= 4K micro-batches keeps the bubble under about 20%.
CHUNKS_PER_STAGE = 4


def default_chunks(stages: int, batch_size: int) -> int:
    """The micro-batch count ``wrap`` and the command line use unless told: ``4 × stages``,
    with at least two samples per micro-batch where the mini-batch has two (batch norm
    cannot train on micro-batches of one sample)."""
    return max(1, min(CHUNKS_PER_STAGE * stages, batch_size // 2))


def default_checkpoint(schedule: str, virtual_stages: int = 1) -> str:
    """The checkpoint mode a pipeline runs with unless told: one rule for every entry point.

    ``except_last`` for one stage per device under ``gpipe`` or ``1f1b``: their stages hold
    many micro-batches' activations at once, and re-computing all but the micro-batch
    whose backward comes first costs one forward per stage and spares most of them.
    ``never`` for interleaved stages (``virtual_stages`` > 1) and zero bubble (``zb``,
    ``zbv``, ``dualpipev``): torch's schedules for them keep every activation unless told.
    Zero bubble can re-compute (``always``, or ``auto`` where a stage does not fit), but
    its weights' gradients run after the input's and need the re-built activations, so a
    re-computed micro-batch saves memory only until its input's gradient
    (:mod:`autopipe.planning.schedules.split_holding`); ``except_last`` has no meaning
    there. Which of them the distributed runner executes: see
    :class:`autopipe.distributed.DistributedPipeline`.
    """
    replayed = virtual_stages > 1 or schedule in ("zb", "zbv", "dualpipev")
    return "never" if replayed else "except_last"


@dataclass(frozen=True)
class PipelineSettings:
    """How a pipeline is planned, built and run; ``None`` fields are decided by :meth:`resolved`.

    Attributes:
        chunks: micro-batches per mini-batch of one replica (M). Default: a given profile's,
            else :func:`default_chunks` of the stages and the batch.
        schedule: ``gpipe``, ``1f1b`` or ``zb``. Default: ``gpipe`` in one process,
            ``1f1b`` across processes.
        checkpoint: ``always``, ``except_last``, ``never`` or ``auto`` (each stage only if
            it does not fit otherwise). Default: :func:`default_checkpoint` of the schedule
            and the virtual stages.
        virtual_stages: stages per device (v), run by an interleaved schedule.
        data_parallel: replicas of the pipeline (D). Default: a given plan's, else 1.
        tensor_parallel: ranks sharding each stage's layers (t): the plan prices one device
            of each stage's tensor-parallel group (``Plan.mesh.tensor``; the profile needs
            shard counts), and the distributed runner shards the stages so.
        memory: device capacity (bytes, ``"16GiB"``, or one per device).
        strategy: how the split is chosen (``optimal``, ``uniform``, ...).
        optimizer: optimizer whose state is counted (``adam``, ``sgd``, ...) or state bytes
            per parameter byte.
        bandwidth: link bandwidth in bytes/s or a rate such as ``"10GB/s"``.
        allreduce_bandwidth: bytes/s of the gradient all-reduce.
        overhead: executor seconds per stage and micro-batch.
        batch: samples per step across all replicas (default: the profile's).
        padded: micro-batches run at the size of the largest.
        shard_optimizer: the replicas shard each stage's optimizer state (ZeRO-1).
        colocated: the stages run in one process, taking turns on devices of one name.
        autocast: ``bfloat16`` or ``float16``: profile (and run) under ``torch.autocast``.
        deferred_batch_norm: BatchNorm statistics updated once per mini-batch (``None``:
            where the model has running statistics and the batch is split).
        init: initializes each stage's part of a model built on the meta device.
        granularity: ``children``, ``blocks`` or ``leaves``: where a traced model is cut.
        leaf_modules: submodule names or classes tracing keeps as opaque calls.
        method: ``auto``, ``fx`` or ``export``: how the model is traced.
        dynamic: the dims besides the batch whose size may vary (torch.export only).
        replicate_shared: a later stage using a shared parameter gets its own copy even
            on the owner's device.
        recompute_norms: plan the layers' normalization outputs re-computed in the
            backward instead of kept (Megatron-LM's ``--recompute-modules layernorm``,
            DeepSeek-V3's RMSNorm re-computation; :mod:`autopipe.planning.recomputed_modules`).
            Planned and exported to Megatron-LM; autopipe's runners re-compute whole
            units only and refuse such a plan.
        recompute_up_proj: plan a latent attention's queries, keys and values re-built
            from its latents in the backward instead of kept (Megatron-LM's
            ``--recompute-modules mla_up_proj``, DeepSeek-V3's training); planned and
            exported as ``recompute_norms``.
    """

    chunks: int | None = None
    schedule: str | None = None
    checkpoint: str | None = None
    virtual_stages: int = 1
    data_parallel: int | None = None
    tensor_parallel: int = 1
    memory: MemorySpec = None
    strategy: str = "optimal"
    optimizer: str | float = "adam"
    bandwidth: float | str | None = None
    allreduce_bandwidth: float | str | None = None
    overhead: float | None = None
    batch: int | None = None
    padded: bool = False
    shard_optimizer: bool = False
    colocated: bool = False
    autocast: str | None = None
    deferred_batch_norm: bool | None = None
    init: Callable[[Any], None] | None = None
    granularity: str = "blocks"
    leaf_modules: tuple[Any, ...] = ()
    method: str = "auto"
    dynamic: Any = None
    replicate_shared: bool = False
    recompute_norms: bool = False
    recompute_up_proj: bool = False

    def __post_init__(self) -> None:
        # A generator given as leaf_modules would be used up by the first trace.
        if not isinstance(self.leaf_modules, tuple):
            object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))

    def resolved(
        self,
        stages: int | None = None,
        batch_size: int | None = None,
        *,
        profile_chunks: int | None = None,
        distributed: bool = False,
    ) -> PipelineSettings:
        """These settings with chunks, schedule and checkpoint decided; the one place that does.

        Args:
            stages: the pipeline's devices (K, not K·v), for :func:`default_chunks`.
            batch_size: the samples of one replica's mini-batch, for
                :func:`default_chunks` (without both, chunks stay as given).
            profile_chunks: the micro-batch count of a given profile, used before
                :func:`default_chunks`.
            distributed: the stages run in processes of their own (``1f1b`` by default),
                not in one (``gpipe``).
        """
        schedule = self.schedule or ("1f1b" if distributed else "gpipe")
        chunks = self.chunks
        if chunks is None:
            chunks = profile_chunks
        if chunks is None and stages is not None and batch_size is not None:
            chunks = default_chunks(stages, batch_size)
        checkpoint = self.checkpoint or default_checkpoint(schedule, self.virtual_stages)
        return dataclasses.replace(self, chunks=chunks, schedule=schedule, checkpoint=checkpoint)


FIELDS = frozenset(f.name for f in dataclasses.fields(PipelineSettings))
# The fields planning reads (through :func:`autopipe.plan`); the others are the runners'.
PLAN_FIELDS = frozenset(
    {
        "chunks",
        "schedule",
        "checkpoint",
        "virtual_stages",
        "data_parallel",
        "tensor_parallel",
        "memory",
        "strategy",
        "optimizer",
        "bandwidth",
        "allreduce_bandwidth",
        "overhead",
        "batch",
        "padded",
        "shard_optimizer",
        "colocated",
        "recompute_norms",
        "recompute_up_proj",
    }
)


def with_overrides(
    settings: PipelineSettings | None,
    overrides: Mapping[str, Any],
    caller: str,
    accepted: Collection[str] = FIELDS,
) -> PipelineSettings:
    """``settings`` (default: all defaults) with the keywords of ``caller()`` laid over it.

    Raises:
        TypeError: ``settings`` is not a :class:`PipelineSettings`, or a keyword is not one
            of ``accepted`` (the message lists them, on one line).
    """
    if settings is None:
        settings = PipelineSettings()
    elif not isinstance(settings, PipelineSettings):
        raise TypeError(
            f"{caller}() takes settings=PipelineSettings(...), got {type(settings).__name__}"
        )
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        word = "keyword arguments" if len(unknown) > 1 else "keyword argument"
        raise TypeError(
            f"{caller}() got an unexpected {word} {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(sorted(accepted))}"
        )
    return dataclasses.replace(settings, **overrides) if overrides else settings
