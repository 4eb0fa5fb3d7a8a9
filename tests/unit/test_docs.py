"""The README and the guides: a short front door, links that resolve, commands that the
real command line accepts, and Python that compiles.

A command that is shown but cannot parse on purpose (output, a usage line with
``[OPTIONS]``) belongs in a ``text`` block, which is not checked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from llm_annotator.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").rglob("*.md")))
MAX_README_LINES = 260
SHELL_LANGUAGES = frozenset({"bash", "console", "sh", "shell"})

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"(`+).+?\1")
_HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = frozenset({"|", "||", "&&", ";", "&"})


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, the line its text starts on, language and text."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Link:
    """A Markdown link or image outside code: its page, line and target."""

    page: Path
    line: int
    target: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@cache
def _split(page: Path) -> tuple[tuple[Block, ...], tuple[tuple[int, str], ...]]:
    """A page's fenced blocks, and its other lines (numbered from 1)."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    lang = ""
    start = 0
    body: list[str] = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            opening = _FENCE.match(line)
            if opening:
                fence, lang, start, body = opening["fence"], opening["lang"], number + 1, []
            else:
                prose.append((number, line))
        elif line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append(Block(page, start, lang.lower(), "\n".join(body)))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page.relative_to(ROOT)}: a code block is never closed"
    return tuple(blocks), tuple(prose)


def _blocks(*languages: str) -> list[Block]:
    return [b for page in PAGES for b in _split(page)[0] if b.lang in languages]


def _links() -> list[Link]:
    found: list[Link] = []
    for page in PAGES:
        for number, line in _split(page)[1]:
            for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
                found.append(Link(page, number, match["target"]))
    return found


def _mkdocs_slug(text: str) -> str:
    """The anchor Python-Markdown's table of contents gives a heading (mkdocs)."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _github_slug(text: str) -> str:
    """The anchor GitHub gives a heading (the README's rendering)."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    anchors: set[str] = set()
    for _, line in _split(page)[1]:
        heading = _HEADING.match(line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading["text"])
            text = text.replace("`", "").replace("*", "")
            anchors |= {_mkdocs_slug(text), _github_slug(text)}
    return frozenset(anchors)


def _command_lines(block: Block) -> list[str]:
    """The command lines of a shell block, continuations joined. In a ``console`` block
    only the lines after a ``$ `` prompt are commands; the rest is their output."""
    logical: list[str] = []
    pending: str | None = None
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if pending is None:
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            pending = ""
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append((pending + line).strip())
        pending = None
    if pending:
        logical.append(pending.strip())
    return logical


def _commands(block: Block) -> list[list[str]]:
    """The ``llm-annotator`` commands of a shell block, as argument lists: comments,
    environment assignments, redirections and the other commands of a pipe or list
    dropped, and ``...`` (an elision of the flags shown before) left out."""
    commands: list[list[str]] = []
    for line in _command_lines(block):
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        segments: list[list[str]] = [[]]
        skip_next = False
        for token in lexer:
            if skip_next:
                skip_next = False
            elif token in _OPERATORS:
                segments.append([])
            elif set(token) <= set("<>&"):  # a redirection: drop it and its target
                skip_next = True
            else:
                segments[-1].append(token)
        for segment in segments:
            while segment and _ENV_ASSIGNMENT.match(segment[0]):
                segment.pop(0)
            if segment and segment[0] == "llm-annotator":
                commands.append([token for token in segment[1:] if token != "..."])
    return commands


@cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


_SHELL_BLOCKS = _blocks(*SHELL_LANGUAGES)
_COMMANDS = [
    pytest.param(command, id=f"{block.where}:{' '.join(command[:2])}")
    for block in _SHELL_BLOCKS
    for command in _commands(block)
]
_PYTHON = [pytest.param(block, id=block.where) for block in _blocks("python", "py")]
_LINKS = [
    pytest.param(link, id=f"{link.where}:{link.target}")
    for link in _links()
    if not re.match(r"^[a-z][a-z0-9+.-]*:", link.target)  # http:, https:, mailto:
]


def test_readme_is_a_front_door() -> None:
    """The README is short, and shows the two set-up commands as commands."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    shown = {
        line.split("#")[0].strip()
        for block in _split(README)[0]
        if block.lang in SHELL_LANGUAGES
        for line in block.text.splitlines()
    }
    assert {"make demo", "make test"} <= shown


def test_pages_have_commands_python_and_links_to_check() -> None:
    """The collection below finds something: a broken pattern would check nothing."""
    assert len(_COMMANDS) >= 20
    assert len(_PYTHON) >= 5
    assert len(_LINKS) >= 20


@pytest.mark.parametrize("link", _LINKS)
def test_relative_link_resolves(link: Link) -> None:
    """Every relative link points to a file that exists, and its anchor to a heading."""
    path, _, anchor = link.target.partition("#")
    target = (link.page.parent / path).resolve() if path else link.page
    assert target.exists(), f"{link.where}: {link.target} does not exist"
    if anchor and target.suffix == ".md":
        assert anchor in _anchors(target), f"{link.where}: no heading #{anchor} in {path}"


@pytest.mark.parametrize("command", _COMMANDS)
def test_shown_command_parses(command: list[str]) -> None:
    """Every ``llm-annotator`` command shown in a shell block parses with the real
    command line: no page shows a flag or subcommand that does not exist."""
    errors = io.StringIO()
    status: int | str | None = None
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            _parser().parse_args(command)
        except SystemExit as exit_:  # --help exits 0, an error 1
            status = exit_.code
    assert status in (0, None), f"{command}: {errors.getvalue().strip()}"


@pytest.mark.parametrize("block", _PYTHON)
def test_python_block_compiles(block: Block) -> None:
    """Every Python block is valid Python."""
    compile(block.text, block.where, "exec")
