"""What a failed trace says (autopipe.graph.trace_errors): each tracer's error on one line,
and the fix that fits what stopped them."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from autopipe.graph.trace_checks import GradientMismatch
from autopipe.graph.trace_errors import failure_message, one_line


def test_one_line_joins_the_lines_and_cuts_at_the_limit() -> None:
    assert one_line(ValueError("a\n  b\tc  ")) == "a b c"
    assert one_line(KeyError()) == "KeyError"  # no message: the type names it
    long = one_line(RuntimeError("x" * 300), limit=20)
    assert long == "x" * 17 + "..." and len(long) == 20
    assert one_line(RuntimeError("y" * 20), limit=20) == "y" * 20


def test_both_tracers_failing_name_each_error_and_the_default_fix() -> None:
    errors: list[tuple[str, BaseException]] = [
        ("fx", TypeError("symbolically traced variables\ncannot be used")),
        ("export", RuntimeError("data-dependent branch")),
    ]
    assert failure_message(nn.Linear(2, 2), errors) == (
        "cannot trace Linear: torch.fx failed: symbolically traced variables cannot be used; "
        "torch.export (non-strict) failed: data-dependent branch. Fix: move the "
        "data-dependent code into a submodule and pass it in leaf_modules=, or express it "
        "with torch.where / torch.cond"
    )


def test_an_fx_failure_inside_a_submodule_suggests_making_it_a_leaf() -> None:
    exc = TypeError("bad branch")
    exc.autopipe_module = ("blocks.1", "Gate")  # type: ignore[attr-defined]
    message = failure_message(nn.Sequential(), [("fx", exc)])
    assert message.startswith("cannot trace Sequential: torch.fx failed in blocks.1 (Gate): ")
    assert message.endswith(
        "Fix: mark that submodule as a leaf (leaf_modules=['blocks.1']) so that it runs as "
        "one opaque call, or express its control flow with torch.where / torch.cond"
    )


def test_a_gradient_mismatch_suggests_the_grad_modes_the_tracers_keep() -> None:
    message = failure_message(nn.Linear(2, 2), [("fx", GradientMismatch("no gradient"))])
    assert "Fix: change the grad mode with torch.no_grad()" in message


def test_a_cache_in_the_outputs_suggests_use_cache_false() -> None:
    exc = RuntimeError("Unsupported <class 'DynamicCache'> in output")
    message = failure_message(nn.Linear(2, 2), [("export", exc)])
    assert message.endswith("Fix: pass use_cache=False (training needs no key/value cache)")


def test_a_grouped_gemm_without_a_kernel_suggests_batched_matmuls() -> None:
    exc = RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16, got Double")
    message = failure_message(nn.Linear(2, 2), [("export", exc)])
    assert "Fix: the experts run a grouped GEMM (torch._grouped_mm)" in message
    assert "set_experts_implementation('batched_mm')" in message


def test_a_branch_on_a_value_names_the_model_s_line_that_export_stopped_at() -> None:
    import torch

    from autopipe.graph.tracing import TracingError, trace

    class Gate(nn.Module):
        """Runs its layer or not by the input's values."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # the line to change
                x = self.layer(x)
            return x

    with pytest.raises(TracingError) as caught:
        trace(nn.Sequential(nn.Linear(4, 4), Gate()), (torch.randn(2, 4),))
    message = str(caught.value)
    lines = Path(__file__).read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if "# the line to" in text)
    site = f"at graph/test_trace_errors.py:{line} in forward (`if x.sum() > 0:"
    assert f"torch.export (non-strict) failed {site}" in message
    # fx stopped inside the gate, so making it a leaf is one fix; the line is the other.
    assert message.endswith(
        "Fix: mark that submodule as a leaf (leaf_modules=['1']) so that it runs as one "
        f"opaque call; or make the code at graph/test_trace_errors.py:{line} in forward not "
        "branch on a tensor's value in training (a random layer drop or mask: a Hugging "
        "Face config turns those off, e.g. layerdrop=0.0, mask_time_prob=0.0), or express "
        "it with torch.where / torch.cond"
    )


def test_a_line_without_its_source_is_named_without_code() -> None:
    text = (
        "Could not guard on data-dependent expression Eq(u0, 1)\n\n"
        'The following call raised this error:\n  File "<stdin>", line 10, in forward\n\n\n'
        "The error above occurred when calling torch.export.export."
    )
    message = failure_message(nn.Linear(2, 2), [("export", RuntimeError(text))])
    assert message.startswith(
        "cannot trace Linear: torch.export (non-strict) failed at <stdin>:10 in forward: "
        "Could not guard on data-dependent expression Eq(u0, 1) The following call"
    )
    assert "Fix: make the code at <stdin>:10 in forward not branch" in message
