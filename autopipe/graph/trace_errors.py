"""What a failed trace says: the construct each tracer stopped at, and the fix to try."""

from __future__ import annotations

import re

from torch import nn

from autopipe.graph.meta import has_meta_state, meta_construct
from autopipe.graph.trace_checks import GradientMismatch

__all__: list[str] = []  # internal to the package


def one_line(exc: BaseException, limit: int = 240) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failure_message(model: nn.Module, errors: list[tuple[str, BaseException]]) -> str:
    """One line on why neither tracer traced ``model``, ending with a fix."""
    eager = _eager_experts_failure(model, errors)
    if eager is not None:
        return eager
    meta = _meta_failure(model, errors)
    if meta is not None:
        return meta
    parts = []
    hint = (
        "move the data-dependent code into a submodule and pass it in leaf_modules=, or "
        "express it with torch.where / torch.cond"
    )
    leaf = False  # whether the fix names fx's submodule as a leaf
    for name, exc in errors:
        where = getattr(exc, "autopipe_module", None)
        if isinstance(exc, GradientMismatch):
            hint = (
                "change the grad mode with torch.no_grad(), torch.enable_grad(), "
                "torch.set_grad_enabled() or torch.inference_mode(), which the tracers keep"
            )
        if name == "fx":
            place = f" in {where[0]} ({where[1]})" if where else ""
            parts.append(f"torch.fx failed{place}: {one_line(exc)}")
            if where:
                leaf = True
                hint = (
                    f"mark that submodule as a leaf (leaf_modules=[{where[0]!r}]) so that it "
                    "runs as one opaque call, or express its control flow with torch.where / "
                    "torch.cond"
                )
        else:
            site = _user_site(exc)
            parts.append(f"torch.export (non-strict) failed{site}: {one_line(exc)}")
            if site and "data-dependent" in str(exc):  # the line export stopped at
                branch = (
                    f"make the code{site.split(' (')[0]} not branch on a tensor's value in "
                    "training (a random layer drop or mask: a Hugging Face config turns "
                    "those off, e.g. layerdrop=0.0, mask_time_prob=0.0), or express it with "
                    "torch.where / torch.cond"
                )
                # fx's leaf may be the fix (the branch inside it), or the line may be.
                hint = f"{hint.split(', or express')[0]}; or {branch}" if leaf else branch
            if "Cache'> in output" in str(exc):
                hint = "pass use_cache=False (training needs no key/value cache)"
            elif _GROUPED_GEMM in str(exc):
                hint = _grouped_experts_hint(model)
    return f"cannot trace {type(model).__name__}: " + "; ".join(parts) + f". Fix: {hint}"


# torch.export names the model's line it stopped at after this sentence.
_SITE = re.compile(
    r"The following call raised this error:\s*"
    r'File "([^"]+)", line (\d+), in (\S+)(?:\n[ \t]+(\S[^\n]*))?'
)


def _user_site(exc: BaseException) -> str:
    """`` at FILE:LINE in FUNCTION (`CODE`)`` where torch.export names the model's line
    that stopped it (a branch on a tensor's value, say), else nothing: the line is what a
    user has to change, and the message's own text would be cut before it."""
    found = _SITE.search(str(exc))
    if found is None:
        return ""
    path, line, function, code = found.groups()
    short = "/".join(path.replace("\\", "/").split("/")[-2:])
    # The line's code where its file can be read (not for code typed at a prompt).
    return f" at {short}:{line} in {function}" + (f" (`{code.strip()}`)" if code else "")


# torch's grouped GEMM (torch._grouped_mm, Hugging Face's default experts kernel) refusing
# another dtype, float64 above all.
_GROUPED_GEMM = "Expected mat_a to be Float32, BFloat16 or Float16"


def _grouped_experts_hint(model: nn.Module) -> str:
    """The fix for experts whose grouped GEMM has no kernel for the model's dtype.

    Making the experts (or their sparse-MoE block) leaves does not help: leaves are for
    torch.fx, which stops earlier in these models (their attention masks branch on
    tensors), and the whole model as a leaf is one unit. Hugging Face's batched-matmul
    experts gather each token's expert weights with plain indexing and matmuls, which
    every dtype has and torch.export traces.
    """
    experts = [
        (name, type(module).__name__)
        for name, module in model.named_modules()
        if getattr(getattr(module, "config", None), "_experts_implementation", None) == "grouped_mm"
        and hasattr(module, "is_concatenated")  # transformers' experts modules
    ]
    where = ""
    if experts:
        names = ", ".join(name for name, _ in experts[:2]) + (", ..." if len(experts) > 2 else "")
        where = f" of {experts[0][1]} ({names})"
    return (
        f"the experts{where} run a grouped GEMM (torch._grouped_mm), which has no kernel for "
        "this dtype: switch them to batched matmuls, model.set_experts_implementation("
        "'batched_mm') (or experts_implementation='batched_mm' in the config), or use "
        "float32 or bfloat16"
    )


def _eager_experts_failure(model: nn.Module, errors: list[tuple[str, BaseException]]) -> str | None:
    """The message for experts that run Hugging Face's eager per-expert loop, which picks
    each expert's tokens with ``nonzero`` on the router's choices: no tracer follows it,
    while the grouped and batched kernels trace (and a count routes them by an
    assumption). ``None`` for other failures."""
    experts = [
        (name, type(module).__name__)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "down_proj", None), nn.Parameter)
        and module.down_proj.dim() == 3  # one matrix per expert
        and getattr(getattr(module, "config", None), "_experts_implementation", "eager")
        in (None, "eager")
    ]
    reads = [
        (name, exc)
        for name, exc in errors
        if "data-dependent" in str(exc) or meta_construct(exc) is not None
    ]
    if not experts or not reads:
        return None
    names = ", ".join(name for name, _ in experts[:2]) + (", ..." if len(experts) > 2 else "")
    tracer, exc = reads[-1]
    return (
        f"cannot trace {type(model).__name__}: the experts of {experts[0][1]} ({names}) run "
        "Hugging Face's eager per-expert loop, which picks each expert's tokens by the "
        f"router's values ({tracer}: {one_line(exc, 120)}). Fix: switch them to a kernel "
        "that traces, model.set_experts_implementation('grouped_mm') (or 'batched_mm'; "
        "experts_implementation= in the config); counting routes their tokens by an "
        "assumption (--expert-skew)"
    )


def _meta_failure(model: nn.Module, errors: list[tuple[str, BaseException]]) -> str | None:
    """The message for a model on meta whose code needs tensor values, else ``None``."""
    if not has_meta_state(model):
        return None
    found = [(name, exc, meta_construct(exc)) for name, exc in errors]
    hits = [(name, exc, construct) for name, exc, construct in found if construct]
    if not hits:
        return None
    name, exc, construct = hits[-1]
    where = getattr(exc, "autopipe_module", None)
    place = f" in {where[0]} ({where[1]})" if where else ""
    return (
        f"cannot trace {type(model).__name__} on the meta device: its code{place} needs "
        f"tensor values, which meta tensors do not hold ({construct}; {name}: "
        f"{one_line(exc, 120)}). Fix: build the model (or the module doing it) with real "
        "weights, or compute that value outside the model and pass it as an input"
    )
