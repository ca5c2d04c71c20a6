"""What the documentation tests read from Markdown: fenced blocks, headings, links, commands."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL_LANGUAGES = ("bash", "sh", "console")
# An HTML comment on the line before a fence, invisible once rendered: the block is
# compiled but not run, for the reason given.
SKIP_MARK = re.compile(r"<!--\s*docs-test:\s*skip\s+(?P<reason>.+?)\s*-->")

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_HEADING = re.compile(r"^(?P<marks>#{1,6}) +(?P<text>.+?) *#* *$")
_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_CODE_SPAN = re.compile(r"`(?P<code>[^`]+)`")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its file, the line of its opening fence, language and text."""

    path: Path
    line: int
    language: str
    text: str
    skip: str | None  # the reason of a docs-test skip mark before it, if any

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One ``autopipe`` command of a shell block, split into its arguments."""

    block: Block
    argv: tuple[str, ...]  # after ``autopipe`` (or ``python -m autopipe``)
    output: tuple[str, ...]  # the lines a console block shows after it

    @property
    def name(self) -> str:
        return f"{self.block.name}: autopipe {shlex.join(self.argv)}"


def split_markdown(path: Path) -> tuple[list[tuple[int, str]], list[Block]]:
    """The file's prose lines (numbered from 1) and its fenced blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    opened: tuple[int, str, str] | None = None  # (line, indent, language)
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if opened is None:
            if fence:
                opened, body = (number, fence["indent"], fence["lang"]), []
            else:
                prose.append((number, line))
        elif fence and not fence["lang"] and fence["indent"] == opened[1]:
            start, indent, language = opened
            mark = SKIP_MARK.search(lines[start - 2]) if start >= 2 else None
            text = "\n".join(row[len(indent) :] if row.startswith(indent) else row for row in body)
            blocks.append(Block(path, start, language, text, mark["reason"] if mark else None))
            opened = None
        else:
            body.append(line)
    assert opened is None, f"{path.name}:{opened[0]}: a fenced block is never closed"
    return prose, blocks


def headings(path: Path) -> list[tuple[int, int, str]]:
    """(line, level, text) of every heading outside fenced blocks."""
    prose, _ = split_markdown(path)
    found = []
    for number, line in prose:
        match = _HEADING.match(line)
        if match:
            found.append((number, len(match["marks"]), match["text"]))
    return found


def slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of the file, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, _, text in headings(path):
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside fenced blocks and code spans."""
    prose, _ = split_markdown(path)
    return [
        (number, match["target"])
        for number, line in prose
        for match in _LINK.finditer(_CODE_SPAN.sub("", line))
    ]


def code_spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span of the prose (one line each)."""
    prose, _ = split_markdown(path)
    return [(number, m["code"]) for number, line in prose for m in _CODE_SPAN.finditer(line)]


def _logical_lines(block: Block) -> list[tuple[str, list[str]]]:
    """A shell block's commands, continuations joined, each with the output lines after it
    (console blocks mark commands with ``$``; every line of a bash block is one)."""
    result: list[tuple[str, list[str]]] = []
    pending = ""
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if pending:
            line, pending = pending + " " + line.lstrip(), ""
        elif block.language == "console":
            if not line.startswith("$ "):
                if result:
                    result[-1][1].append(line)
                continue
            line = line[2:]
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        result.append((line, []))
    return result


def commands(block: Block) -> list[Command]:
    """The ``autopipe`` commands of a shell block, one per ``&&`` part, comments dropped."""
    found = []
    for line, output in _logical_lines(block):
        words = shlex.split(line, comments=True)
        parts: list[list[str]] = [[]]
        for word in words:
            if word == "&&":
                parts.append([])
            else:
                parts[-1].append(word)
        for part in parts:
            if part[:1] == ["autopipe"]:
                found.append(Command(block, tuple(part[1:]), tuple(output)))
            elif part[:3] == ["python", "-m", "autopipe"]:
                found.append(Command(block, tuple(part[3:]), tuple(output)))
    return found


def all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in split_markdown(path)[1]]


def all_commands() -> list[Command]:
    return [
        command
        for block in all_blocks()
        if block.language in SHELL_LANGUAGES
        for command in commands(block)
    ]
