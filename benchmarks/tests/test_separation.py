"""The library's tests stand without the benchmarks: nothing under tests/ imports benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"


def _imported(path: Path) -> set[str]:
    """Top-level package of every module the file imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_imports_the_benchmarks() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert files, f"no test files under {TESTS}"
    offenders = [str(f.relative_to(TESTS)) for f in files if "benchmarks" in _imported(f)]
    assert offenders == []
