"""Tests of the ``autopipe`` argument parser: help, version, usage errors (autopipe.cli.parser)."""

from __future__ import annotations

import pytest

import autopipe
from autopipe.cli.arguments import GRANULARITIES as CLI_GRANULARITIES
from tests.support.cli_support import MLP, assert_error, run


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0 and "--stages" in out and "nn.Sequential" in out
    for option in ("--granularity", "--leaf-modules", "--warmup", "--virtual-stages"):
        assert option in out
    code, out, _ = run(capsys, "--help")
    text = " ".join(out.split())
    assert code == 0 and "any nn.Module" in text and "`kwargs`" in text
    assert "an nn.Sequential (or a function returning one)" not in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--version")
    assert (code, out, err) == (0, f"autopipe {autopipe.__version__}\n", "")
    assert autopipe.__version__ == "0.1.0"


def test_granularities_match_the_tracer() -> None:
    from autopipe.graph.units import GRANULARITIES

    assert CLI_GRANULARITIES == GRANULARITIES


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["plan", "--stages", "0", MLP],
        ["plan", "--checkpoint", "sometimes", MLP],
        ["plan", "--chunks", "x", MLP],
        ["profile", MLP],
    ],
)
def test_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == "" and "Traceback" not in err
    # One line, like every other error, with where to read more instead of the usage.
    (line,) = err.splitlines()
    command = f"autopipe {argv[0]}" if argv[:1] in (["plan"], ["profile"]) else "autopipe"
    assert line.startswith(f"{command}: error: ") and line.endswith(f"(see {command} --help)")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--memory", "-5GiB"], "memory size '-5GiB' is negative"),
        (["--memory", "1GiB,-2GiB"], "memory size '-2GiB' is negative"),
        (["--bandwidth", "-1GB"], "bandwidth must be positive, got '-1GB'"),
        (["--optimizer", "-1.5"], "optimizer state factor must be a finite number >= 0"),
    ],
)
def test_negative_looking_values_are_values_and_refused(
    capsys: pytest.CaptureFixture[str], option: list[str], message: str
) -> None:
    # argparse reads `-5GiB` as an unknown option unless told that it is a value.
    code, out, err = run(capsys, "plan", MLP, *option)
    assert_error(code, out, err, message)
