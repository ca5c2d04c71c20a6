"""The layout rules lint-imports cannot state: no import cycle, no private import, other
packages imported through their faces only, one name per module, tests that mirror the
modules, faces that load on first use, no function of ten parameters."""

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
# A package's face is its __init__: what other packages may import of it.
FACES = {"autopipe", "profiler", *SUBPACKAGES}


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


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{module}:{node.lineno} takes {name} from {node.module}"
        for module, tree in SOURCES.items()
        for node, name in _imports_from(tree)
        if name.startswith("_") and not name.startswith("__") and node.module != module
    ]
    assert found == []


def _package(module: str) -> str:
    """The package whose face speaks for the module: ``autopipe.graph`` for
    ``autopipe.graph.layout``, ``autopipe`` for ``autopipe.errors``, ``profiler``."""
    parts = module.split(".")
    if len(parts) > 1 and f"{parts[0]}.{parts[1]}" in SUBPACKAGES:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _homes(tree: ast.Module) -> dict[str, str]:
    """A face's ``_HOMES``: each name it offers -> the module it loads the name from."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_HOMES" for t in node.targets
        ):
            return dict(ast.literal_eval(node.value))
    return {}


def _defined(tree: ast.Module) -> set[str]:
    """The names a module binds at its top: definitions, assignments and imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return names


def _imported(tree: ast.Module) -> set[str]:
    return {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }


def test_other_packages_import_only_from_faces():
    """A library module takes another package's names from its face (``from autopipe.graph
    import Layout``), never from one of that package's modules."""
    found = [
        f"{module}:{node.lineno} takes {name} from {node.module}"
        for module, tree in SOURCES.items()
        for node, name in _imports_from(tree)
        if _package(node.module or "") != _package(module) and node.module not in FACES
    ]
    assert found == []


def test_other_packages_import_only_the_names_a_face_lists():
    found = []
    for module, tree in SOURCES.items():
        for node, name in _imports_from(tree):
            source = node.module or ""
            if source not in FACES or _package(source) == _package(module):
                continue
            if name not in (_public_names(SOURCES[source]) or []) and not name.startswith("__"):
                found.append(f"{module}:{node.lineno} takes {name} from {source}")
    assert found == []


def test_every_name_a_face_lists_has_a_home_that_defines_it():
    """Each name in a face's ``__all__`` is bound in the face or in the module its ``_HOMES``
    names: its own package's module, or another face that lists it."""
    found = []
    for face in sorted(FACES):
        homes = _homes(SOURCES[face])
        for name in _public_names(SOURCES[face]) or []:
            if name in _defined(SOURCES[face]):
                continue
            home = homes.get(name)
            if home is None or home not in SOURCES:
                found.append(f"{face}.{name}: no home")
            elif home in FACES and home != face:
                if name not in (_public_names(SOURCES[home]) or []):
                    found.append(f"{face}.{name}: {home} does not list it")
            elif _package(home) != face or name not in _defined(SOURCES[home]):
                found.append(f"{face}.{name}: {home} does not define it")
    assert found == []


def test_a_module_lists_only_what_its_face_offers():
    """Outside the faces, a module's ``__all__`` names what its face loads from it (and names
    it re-exports); a module its face loads nothing from lists none: it is internal."""
    offered: dict[str, set[str]] = {}
    for face in FACES:
        for name, home in _homes(SOURCES[face]).items():
            offered.setdefault(home, set()).add(name)
    found = [
        f"{module} lists {name}"
        for module, tree in SOURCES.items()
        if module not in FACES
        for name in _public_names(tree) or []
        if name not in offered.get(module, set()) and name not in _imported(tree)
    ]
    assert found == []


def test_subpackages_state_their_public_names():
    missing = [name for name in sorted(SUBPACKAGES) if not _public_names(SOURCES[name])]
    assert SUBPACKAGES and missing == []


def test_no_public_name_shadows_a_module_of_its_package():
    """``package.name`` is one attribute: a function named like a submodule hides it."""
    shadowed = [
        f"{package}.{name}"
        for package in sorted(FACES)
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


@pytest.mark.parametrize("face", sorted(FACES))
def test_a_face_loads_its_modules_on_first_use(face: str):
    """Importing a face loads no module of the library but the faces and their helper; each
    name the face lists then resolves."""
    code = (
        "import importlib, sys\n"
        f"face = importlib.import_module({face!r})\n"
        f"faces = {sorted(FACES)!r} + ['profiler.faces']\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('autopipe', 'profiler')\n"
        "             and m not in faces))\n"
        "print(all(getattr(face, name) is not None for name in face.__all__))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\nTrue\n", "")
