"""What a failed trace says: the construct each tracer stopped at, and the fix to try."""

from __future__ import annotations

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
    meta = _meta_failure(model, errors)
    if meta is not None:
        return meta
    parts = []
    hint = (
        "move the data-dependent code into a submodule and pass it in leaf_modules=, or "
        "express it with torch.where / torch.cond"
    )
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
                hint = (
                    f"mark that submodule as a leaf (leaf_modules=[{where[0]!r}]) so that it "
                    "runs as one opaque call, or express its control flow with torch.where / "
                    "torch.cond"
                )
        else:
            parts.append(f"torch.export (non-strict) failed: {one_line(exc)}")
            if "Cache'> in output" in str(exc):
                hint = "pass use_cache=False (training needs no key/value cache)"
    return f"cannot trace {type(model).__name__}: " + "; ".join(parts) + f". Fix: {hint}"


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
