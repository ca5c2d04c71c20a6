"""Tests of a lazy face (profiler.faces): a name loads its module on first use, and reads it
again on every lookup."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FACE = """
from profiler import lazy_face

__all__ = ["VALUE", "double"]
_HOMES = {"VALUE": "facepkg.values", "double": "facepkg.values"}
_MODULES = {"values_module": "facepkg.values"}

__getattr__, __dir__ = lazy_face(__name__, _HOMES, _MODULES)
"""

VALUES = """
VALUE = 3


def double(x):
    return 2 * x
"""


@pytest.fixture
def face(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    package = tmp_path / "facepkg"
    package.mkdir()
    (package / "__init__.py").write_text(FACE)
    (package / "values.py").write_text(VALUES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import facepkg  # type: ignore[import-not-found]

    yield facepkg
    for name in [m for m in sys.modules if m.split(".")[0] == "facepkg"]:
        del sys.modules[name]


def test_a_name_loads_its_module_on_first_use(face: object) -> None:
    assert "facepkg.values" not in sys.modules
    from facepkg import double  # type: ignore[import-not-found]

    assert "facepkg.values" in sys.modules and double(4) == 8


def test_each_lookup_reads_the_home_module_again(
    face: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert face.VALUE == 3  # type: ignore[attr-defined]
    monkeypatch.setattr(sys.modules["facepkg.values"], "VALUE", 5)
    from facepkg import VALUE  # type: ignore[import-not-found]

    assert (VALUE, face.VALUE) == (5, 5)  # type: ignore[attr-defined]


def test_a_short_name_stands_for_a_module(face: object) -> None:
    assert face.values_module is sys.modules["facepkg.values"]  # type: ignore[attr-defined]


def test_an_unknown_name_is_an_attribute_error(face: object) -> None:
    with pytest.raises(AttributeError, match="module 'facepkg' has no attribute 'missing'"):
        face.missing  # type: ignore[attr-defined]  # noqa: B018


def test_dir_lists_the_names_and_the_short_names(face: object) -> None:
    assert {"VALUE", "double", "values_module"} <= set(dir(face))
