"""The README and docs/ stay true: links resolve, headings nest, named files and modules
exist, and every ``autopipe`` command and Python example they show works.

Every command of a ```bash, ```sh or ```console block is parsed by the real argument
parser. It is also run when it is cheap: its model is examples/mlp.py (or it takes none),
it starts no processes (no ``--ranks``), it times no whole training steps (``bench``,
``calibrate --model``) and each file it reads is written by an earlier command of the
same page; then it runs in a temporary folder with one timed run per layer
(``--repeats 1 --warmup 0`` and the like, which change how precisely a layer is timed, not
what the command does). The others are skipped with that reason. A Python block runs when
it defines every name it uses and carries no ``<!-- docs-test: skip REASON -->`` mark; a
fragment (it uses names defined elsewhere) is compiled and its autopipe imports are run.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import itertools
import re
import shlex
from pathlib import Path

import pytest

from autopipe.cli import main
from autopipe.cli.parser import build_parser, selected_command
from tests.support.markdown import (
    DOC_FILES,
    ROOT,
    Block,
    Command,
    all_blocks,
    all_commands,
    anchors,
    code_spans,
    commands,
    headings,
    links,
    split_markdown,
)

README = ROOT / "README.md"
CHEAP_MODEL = "examples/mlp.py"
# Options that only set how precisely layers are timed, per command.
FAST = {
    "plan": {"--repeats": "1", "--warmup": "0"},
    "profile": {"--repeats": "1", "--warmup": "0"},
    "calibrate": {"--repeats": "1"},
}
COMMANDS = all_commands()
PYTHON_BLOCKS = [block for block in all_blocks() if block.language == "python"]


def _page(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ----------------------------------------------------------------------------------------
# Structure: headings, links, names.


@pytest.mark.parametrize("path", DOC_FILES, ids=_page)
def test_headings_nest(path: Path) -> None:
    found = headings(path)
    assert found and found[0][1] == 1, "a page starts with its title"
    assert [level for _, level, _ in found].count(1) == 1, "one title per page"
    skips = [
        f"line {line}: {text!r} is level {level} under level {before}"
        for (_, before, _), (line, level, text) in itertools.pairwise(found)
        if level > before + 1
    ]
    assert skips == []


@pytest.mark.parametrize("path", DOC_FILES, ids=_page)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for line, target in links(path):
        if re.match(r"^[a-z]+:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"line {line}: {target} (no {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"line {line}: {target} (no heading #{anchor})")
    assert broken == []


def _named_path_exists(text: str) -> bool | None:
    """Whether a code span that names a file or folder of the repository names one that
    exists (also under autopipe/, as docs/layout.md writes ``planning/...``); ``None``
    when it names none (a user's file, a pattern)."""
    if "<" in text or "*" in text or " " in text or "/" not in text:
        return None
    first = text.split("/")[0]
    if first in ("autopipe", "profiler", "benchmarks", "examples", "tests", "docs", ".ci"):
        return (ROOT / text).exists()
    if (ROOT / "autopipe" / first / "__init__.py").exists():
        return (ROOT / "autopipe" / text).exists()
    return None


def _dotted_name_exists(name: str) -> bool:
    """Whether ``autopipe.x.y`` (a module, then attributes) imports."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


@pytest.mark.parametrize("path", DOC_FILES, ids=_page)
def test_named_files_and_modules_exist(path: Path) -> None:
    missing = []
    for line, text in code_spans(path):
        script = re.match(r"^python -m (benchmarks(?:\.\w+)+)", text)
        if script:
            module = ROOT.joinpath(*script[1].split("."))
            if not (module.with_suffix(".py").exists() or (module / "__init__.py").exists()):
                missing.append(f"line {line}: {text}")
        elif re.fullmatch(r"(autopipe|profiler)(\.[A-Za-z_]\w*)+", text):
            if not _dotted_name_exists(text):
                missing.append(f"line {line}: {text}")
        elif _named_path_exists(text) is False:
            missing.append(f"line {line}: {text}")
    assert missing == []


# ----------------------------------------------------------------------------------------
# The README's set-up.


def _words(line: str) -> list[str]:
    """A shell step as CI and a reader run it alike: ``python -m pip`` is ``pip``, quiet."""
    words = [word for word in shlex.split(line, comments=True) if word != "--quiet"]
    return words[2:] if words[:3] == ["python", "-m", "pip"] else words


def test_readme_begins_with_the_setup_commands() -> None:
    found = headings(README)
    sections = [(line, text) for line, level, text in found if level == 2]
    assert sections[0][1] == "Set-up", "the set-up is the README's first section"
    start, end = sections[0][0], sections[1][0]
    _, blocks = split_markdown(README)
    main_job, tests = blocks[:2]
    assert all(start < block.line < end and block.language == "bash" for block in blocks[:2])
    # The main job ends with an autopipe command, which the command tests parse and run.
    assert commands(main_job) and main_job.text.count("\n") == 0
    assert main_job.text.endswith(shlex.join(("autopipe", *commands(main_job)[-1].argv)))
    # CI runs the README's test command, step by step.
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")  # continuations joined
    ci = [_words(line) for line in script.splitlines()]
    steps = [_words(step) for step in tests.text.split("&&")]
    assert steps[-1][:3] == ["python", "-m", "pytest"]
    assert [step for step in steps if step not in ci] == []


# ----------------------------------------------------------------------------------------
# Commands.


def _parse(command: Command) -> argparse.Namespace:
    try:
        args = build_parser().parse_args(list(command.argv))
    except SystemExit as exc:
        pytest.fail(f"{command.name}: the parser refuses it (status {exc.code})")
    selected_command(args)  # the refusals of option combinations, without running
    return args


def _reads(args: argparse.Namespace) -> list[str]:
    files = [getattr(args, "profile", None), getattr(args, "fit", None)]
    return [file for file in files if file]


def _writes(args: argparse.Namespace) -> list[str]:
    return [file for file in (getattr(args, "output", None), getattr(args, "json", None)) if file]


def _why_not_run(command: Command, earlier: list[Command]) -> str | None:
    args = _parse(command)
    model = getattr(args, "model", None)
    if model == "model.py":
        return "model.py stands for the reader's model: parsed only"
    if model not in (None, CHEAP_MODEL):
        return f"{model} is not {CHEAP_MODEL}: parsed only (it profiles for long)"
    if getattr(args, "ranks", None):
        return f"--ranks {args.ranks} starts processes: parsed only"
    if args.command == "bench" or (args.command == "calibrate" and args.model):
        # tests/cli/test_bench_command.py and test_calibrate.py run them on small models.
        return f"{args.command} times whole training steps (minutes here): parsed only"
    written = {file for other in earlier for file in _writes(_parse(other))}
    for file in _reads(args):
        if file not in written:
            return f"reads {file}, which no earlier command of the page writes: parsed only"
    return None


def _page_commands(command: Command) -> list[Command]:
    """The commands of the page before ``command``, in order."""
    before = COMMANDS[: COMMANDS.index(command)]
    return [other for other in before if other.block.path == command.block.path]


def _run(command: Command, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    argv = [
        str(ROOT / word) if word.endswith(".py") and (ROOT / word).is_file() else word
        for word in command.argv
    ]
    for option, value in FAST.get(argv[0], {}).items():
        if option not in argv:
            argv += [option, value]
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _device_free(line: str) -> str:
    """A report line without the devices it names (``[cpu]``, ``[cuda:0, cuda:1]``)."""
    return re.sub(r"\[[^\]]*\]", "[...]", line)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.name)
def test_command_parses(command: Command) -> None:
    assert _parse(command).command == command.argv[0]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.name)
def test_command_runs(
    command: Command,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    earlier = _page_commands(command)
    reason = _why_not_run(command, earlier)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    # Whatever earlier commands of the page write that this one reads, in page order.
    needed = set(_reads(_parse(command)))
    for other in reversed(earlier):
        if needed & set(_writes(_parse(other))):
            needed |= set(_reads(_parse(other)))
    for other in [c for c in earlier if needed & set(_writes(_parse(c)))]:
        code, _, err = _run(other, capsys)
        assert code == 0, f"{other.name}: {err}"
    code, out, err = _run(command, capsys)
    shown = [line for line in command.output if line.strip()]
    if shown and shown[0].startswith("autopipe: error:"):
        assert (code, err.splitlines()[-1:]) == (2, shown[:1])
        return
    assert code == 0, err
    if shown and shown[0] != "...":
        assert _device_free(out.splitlines()[0]) == _device_free(shown[0])


# ----------------------------------------------------------------------------------------
# Python blocks.


def _free_names(tree: ast.Module) -> set[str]:
    """Names the code reads but neither defines, imports nor gets from builtins."""
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    read = {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    return read - bound


def _own_imports(tree: ast.Module) -> list[ast.stmt]:
    """The block's imports of autopipe and profiler (peers' packages are not all here)."""
    found: list[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        if all(name.split(".")[0] in ("autopipe", "profiler") for name in names):
            found.append(node)
    return found


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda block: block.name)
def test_python_block(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tree = ast.parse(block.text, block.name)
    monkeypatch.chdir(tmp_path)
    free = _free_names(tree)
    if free:  # a fragment: its names come from the text around it
        for node in _own_imports(tree):
            exec(compile(ast.Module([node], []), block.name, "exec"), {})
        return
    if block.skip:
        pytest.skip(block.skip)
    exec(compile(tree, block.name, "exec"), {"__name__": "__docs__"})
