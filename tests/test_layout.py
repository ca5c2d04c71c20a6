"""The layout rules lint-imports cannot state: no import cycle, no private or internal import,
one name per module, tests that mirror the modules, faces that load on first use, no function
of ten parameters."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autopipe", "profiler")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, ast.Module]:
    return {
        _module_name(path): ast.parse(path.read_text(), str(path))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


SOURCES = _sources()
SUBPACKAGES = {_module_name(path.parent) for path in (ROOT / "autopipe").glob("*/__init__.py")}


def _imports_from(tree: ast.Module) -> Iterator[tuple[ast.ImportFrom, str]]:
    """Every ``from <library module> import name`` in the module, functions included."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                yield node, alias.name


def _public_names(tree: ast.Module) -> list[str] | None:
    """The module's ``__all__``, or ``None`` when it has none."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__":
            value = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            return list(value)
    return None


def _subpackage(module: str) -> str:
    """``autopipe.graph`` for ``autopipe.graph.layout``; the top package for the others."""
    parts = module.split(".")
    if len(parts) > 1 and f"{parts[0]}.{parts[1]}" in SUBPACKAGES:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{module}:{node.lineno} takes {name} from {node.module}"
        for module, tree in SOURCES.items()
        for node, name in _imports_from(tree)
        if name.startswith("_") and not name.startswith("__") and node.module != module
    ]
    assert found == []


def test_other_layers_import_only_the_names_a_module_lists_in_all():
    """A subpackage's module lists in ``__all__`` what the other layers may import from it;
    an empty ``__all__`` marks a module internal to its subpackage."""
    found = []
    for module, tree in SOURCES.items():
        for node, name in _imports_from(tree):
            source = node.module or ""
            if not source.startswith("autopipe.") or _subpackage(source) == _subpackage(module):
                continue
            if f"{source}.{name}" in SOURCES or name.startswith("__"):
                continue  # a submodule, or a dunder such as __version__
            public = _public_names(SOURCES[source]) if source in SOURCES else None
            if public is None or name not in public:
                found.append(f"{module}:{node.lineno} takes {name} from {source}")
    assert found == []


def test_subpackages_state_their_public_names():
    missing = [name for name in sorted(SUBPACKAGES) if not _public_names(SOURCES[name])]
    assert SUBPACKAGES and missing == []


def test_no_public_name_shadows_a_module_of_its_package():
    """``package.name`` is one attribute: a function named like a submodule hides it."""
    shadowed = [
        f"{package}.{name}"
        for package in sorted(SUBPACKAGES)
        for name in _public_names(SOURCES[package]) or []
        if f"{package}.{name}" in SOURCES
    ]
    assert shadowed == []


def test_no_import_cycle_in_the_library():
    grimp = pytest.importorskip("grimp")  # installed with import-linter
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    imports = nx.DiGraph()
    for module in graph.modules:
        imports.add_node(module)
        for imported in graph.find_modules_directly_imported_by(module):
            imports.add_edge(module, imported)
    cycles = [
        " -> ".join(edge[0] for edge in nx.find_cycle(imports.subgraph(component)))
        for component in nx.strongly_connected_components(imports)
        if len(component) > 1
    ]
    assert cycles == []


def _module_homes() -> dict[str, list[Path]]:
    """Each module's file name (``exact``) -> the folders that hold a module of that name."""
    homes: dict[str, list[Path]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py":
                homes.setdefault(path.stem, []).append(path.parent.relative_to(ROOT))
    return homes


def test_no_two_modules_share_a_name():
    """One name, one module: ``tied`` is profiler's, the runners' are named by their role."""
    homes = _module_homes()
    assert {name: folders for name, folders in homes.items() if len(folders) > 1} == {}


def test_no_planning_folder_holds_more_than_15_modules():
    planning = ROOT / "autopipe" / "planning"
    sizes = {
        str(folder.relative_to(ROOT)): len([p for p in folder.glob("*.py") if p.stem != "__init__"])
        for folder in [planning, *(path for path in planning.iterdir() if path.is_dir())]
        if (folder / "__init__.py").exists()
    }
    assert len(sizes) > 1 and {folder: n for folder, n in sizes.items() if n > 15} == {}


def test_tests_mirror_the_modules():
    """``tests/planning/split/test_exact.py`` tests ``autopipe/planning/split/exact.py``: a test
    named after a module sits in the folder that mirrors the module's."""
    homes = _module_homes()
    misplaced = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        folder = path.parent.relative_to(ROOT / "tests")
        if not folder.parts or folder.parts[0] in ("support", "torchgpipe_conformance"):
            continue
        for home in homes.get(path.stem.removeprefix("test_"), []):
            mirrored = home if home.parts[0] == "profiler" else home.relative_to("autopipe")
            if folder != mirrored:
                misplaced.append(f"{path.relative_to(ROOT)} tests {home}")
    assert misplaced == []


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Every parameter of the function, ``*args`` and ``**kwargs`` included, but a
    method's ``self`` or ``cls``."""
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    names = [a.arg for a in named] + [a.arg for a in (args.vararg, args.kwarg) if a]
    return names[1:] if names and names[0] in ("self", "cls") else names


def test_no_library_function_takes_ten_parameters():
    """Where ten would be needed, a settings object serves (``PipelineSettings``,
    ``SearchOptions``, ``CostOptions``, ``MeasureSettings``, ...)."""
    found = [
        f"{module}:{node.lineno} {node.name} takes {len(_parameters(node))}"
        for module, tree in SOURCES.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and len(_parameters(node)) >= 10
    ]
    assert len(SOURCES) > 100 and found == []


@pytest.mark.parametrize("face", ["autopipe.planning", "autopipe.output"])
def test_a_face_loads_its_modules_on_first_use(face: str):
    """Importing the face loads none of its modules; each public name then resolves."""
    code = (
        "import importlib, sys\n"
        f"face = importlib.import_module({face!r})\n"
        f"print(sorted(m for m in sys.modules if m.startswith({face + '.'!r})))\n"
        "print(all(getattr(face, name) is not None for name in face.__all__))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\nTrue\n", "")
