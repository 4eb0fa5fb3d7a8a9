"""The README and the guides: a short front door, links that resolve, commands that the
real command line accepts, Python that runs, and TOML files that the loaders take.

A command that is shown but cannot parse on purpose (output, a usage line with
``[OPTIONS]``) belongs in a ``text`` block, which is not checked.

Every Python block runs, in a temporary directory, against fake vLLM servers on loopback
(``tests.unit.docs_servers``): each server URL the block names
(``http://gpu-1:8000/v1``) is replaced by a fake's, the files of ``INPUT_FILES`` are
there to read, and a name the block uses without defining it (``urls``, ``texts``: what
the page's prose or an earlier block gave) comes from ``GIVEN_SERVERS`` or
``GIVEN_VALUES``. Comment lines right after a ``print(...)`` show what it prints, any
number aside. A block that cannot run here says why in the comment right before it,
``<!-- not run: REASON -->``, and is still compiled.

A TOML block is read by the project's own loaders, from the repository's root as the
guides run their files: a pipeline file (it has ``[steps.NAME]`` tables) as
``llm-annotator pipeline run`` reads it; keys of one step (a key only steps take, or
alternatives of one key) each in a step of a small pipeline file; else a job file, as
``llm-annotator run --config`` reads it.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import copy
import io
import re
import shlex
import tomllib
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import orjson
import pytest

from llm_annotator.cli._offline import SERVER_SETTINGS
from llm_annotator.cli.main import build_parser
from llm_annotator.cli.pipeline import STEP_KEYS, load_pipeline
from llm_annotator.cli.run import settings_from
from tests.unit.docs_servers import fake_vllm_servers

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").rglob("*.md")))
MAX_README_LINES = 260
SHELL_LANGUAGES = frozenset({"bash", "console", "sh", "shell"})
PYTHON_LANGUAGES = frozenset({"python", "py"})
PLAIN_LANGUAGES = frozenset({"", "text"})
"""Blocks that are not checked: output, a directory's tree, an error message."""
RUN_TIMEOUT = 60
"""Seconds a Python block may take against the fake servers (it takes well under one)."""

_SCHEMAS = ROOT / "examples" / "pipeline"
_REVIEWS = (
    "Absolutely loved it, I would order again tomorrow.",
    "The food was awful and cold.",
    "The staff were warm and the room was spotless.",
    "Waited an hour for a lukewarm pizza.",
    "Great value, friendly people, will be back.",
    "The speaker crackles and the bass is muddy.",
)


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


INPUT_FILES: dict[str, bytes] = {
    "reviews.jsonl": _jsonl(
        [{"id": i, "review_id": f"r{i}", "text": text} for i, text in enumerate(_REVIEWS)]
    ),
    "questions.jsonl": _jsonl(
        [
            {"doc_id": f"d{i // 2}", "document": f"Report {i // 2}: sales rose.", "question": q}
            for i, q in enumerate(["Who wrote it?", "What rose?"] * 2)
        ]
    ),
    "sentiment.schema.json": (_SCHEMAS / "sentiment.json").read_bytes(),
}
"""The files a Python block may read, made in its working directory."""

GIVEN_SERVERS: dict[str, int] = {"urls": 2, "strong_urls": 1}
"""Names a block may use undefined that hold server URLs: that many fake servers' each."""

GIVEN_VALUES: dict[str, Any] = {
    "texts": list(_REVIEWS),
    "conversations": [[{"role": "user", "content": f"Classify: {t}"}] for t in _REVIEWS],
    "schema": orjson.loads(INPUT_FILES["sentiment.schema.json"]),
    "sentiment_schema": orjson.loads((_SCHEMAS / "sentiment.json").read_bytes()),
    "reason_schema": orjson.loads((_SCHEMAS / "reason.json").read_bytes()),
    "verdict_schema": orjson.loads((_SCHEMAS / "verdict.json").read_bytes()),
}
"""Other names a block may use undefined, and their values."""

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"(`+).+?\1")
_HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = frozenset({"|", "||", "&&", ";", "&"})
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")
_NOT_RUN_ANY = re.compile(r"<!--\s*not run\b")
_SERVER_URL = re.compile(r"https?://[\w.-]+:\d+/v1\b")
_ANY_URL = re.compile(r"\bhttps?://(?P<host>[^/:\s\"'\]]+)")
_STEP_ONLY = frozenset(STEP_KEYS) - {"input"}
_JOB_FLAGS = {
    "input": ("--input", "reviews.jsonl"),
    "prompt_template": ("--prompt-template", "{text}"),
    "output_dir": ("--output-dir", "runs/job"),
}
"""What ``run`` needs that a job file may leave to the command line, and a stand-in."""
_TOML_KEY = re.compile(r"^[A-Za-z_\"][\w.\"-]*\s*=")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, the line its text starts on, language and text,
    and the reason it is not run when the comment before it gives one."""

    page: Path
    line: int
    lang: str
    text: str
    not_run: str | None = None

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
    marker: str | None = None  # the reason of a not-run comment just before
    not_run: str | None = None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            opening = _FENCE.match(line)
            if opening:
                fence, lang, start, body = opening["fence"], opening["lang"], number + 1, []
                not_run, marker = marker, None
            else:
                prose.append((number, line))
                if line.strip():
                    found = _NOT_RUN.match(line)
                    marker = found["reason"] if found else None
        elif line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append(Block(page, start, lang.lower(), "\n".join(body), not_run))
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
_PYTHON = [pytest.param(block, id=block.where) for block in _blocks(*PYTHON_LANGUAGES)]
_PYTHON_RUN = [
    pytest.param(
        block,
        id=block.where,
        marks=[pytest.mark.skip(reason=f"not run: {block.not_run}")] if block.not_run else [],
    )
    for block in _blocks(*PYTHON_LANGUAGES)
]
_TOML = [pytest.param(block, id=block.where) for block in _blocks("toml")]
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
    assert sum(not block.not_run for block in _blocks(*PYTHON_LANGUAGES)) >= 5
    assert len(_TOML) >= 2
    assert len(_LINKS) >= 20


def test_every_block_is_of_a_checked_language() -> None:
    """A block in a language this module does not check (``yaml``, ``json``) would be
    shown unchecked: a new language needs its check here first, or ``text``."""
    known = SHELL_LANGUAGES | PYTHON_LANGUAGES | PLAIN_LANGUAGES | {"toml"}
    unknown = [f"{b.where} ({b.lang})" for p in PAGES for b in _split(p)[0] if b.lang not in known]
    assert not unknown, f"blocks in a language that is not checked: {', '.join(unknown)}"


def test_not_run_markers_give_a_reason_before_a_python_block() -> None:
    """``<!-- not run: REASON -->`` says why, and stands right before a Python block."""
    markers = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in PAGES
        for number, line in _split(page)[1]
        if _NOT_RUN_ANY.search(line)
    ]
    marked = [b for b in _blocks(*PYTHON_LANGUAGES) if b.not_run]
    wrong = [b.where for p in PAGES for b in _split(p)[0] if b.not_run and b.lang != "python"]
    assert not wrong, f"a not-run marker before a block that is not Python: {wrong}"
    assert len(marked) == len(markers), (
        f"not-run markers without a reason, or not right before a Python block: {markers}"
    )


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


def _free_names(text: str) -> set[str]:
    """The names a block reads but neither defines, imports nor gets from Python."""
    loaded: set[str] = set()
    bound: set[str] = set(dir(builtins))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def _shown_output(text: str) -> list[str]:
    """The comment lines right after each ``print(...)``: what it prints."""
    lines = text.splitlines()
    shown: list[str] = []
    for number, line in enumerate(lines):
        if line.lstrip().startswith("print("):
            following = lines[number + 1 :]
            for comment in following:
                if not comment.lstrip().startswith("# "):
                    break
                shown.append(comment.lstrip()[2:].strip())
    return shown


def _like(shown: str) -> re.Pattern[str]:
    """A printed line like ``shown``, whatever its numbers (the guides' runs are bigger)."""
    parts = re.split(r"\d+(?:\.\d+)?", shown)
    return re.compile(r"\d+(?:\.\d+)?".join(re.escape(part) for part in parts))


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("block", _PYTHON_RUN)
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python block runs against fake vLLM servers, its URLs theirs, in a
    directory that holds the files it reads, and prints what its comments show."""
    free = _free_names(block.text)
    unknown = free - GIVEN_SERVERS.keys() - GIVEN_VALUES.keys()
    assert not unknown, f"{block.where} uses {sorted(unknown)}: define them, or give them here"
    named = list(dict.fromkeys(_SERVER_URL.findall(block.text)))
    given = sorted(free & GIVEN_SERVERS.keys())
    for name, content in INPUT_FILES.items():
        (tmp_path / name).write_bytes(content)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    count = len(named) + sum(GIVEN_SERVERS[name] for name in given)
    with fake_vllm_servers(count) as servers:
        urls = iter(server.base_url for server in servers)
        replaced = {url: next(urls) for url in named}
        text = _SERVER_URL.sub(lambda found: replaced[found[0]], block.text)
        namespace: dict[str, Any] = {"__name__": "__main__"}
        namespace |= {
            name: copy.deepcopy(GIVEN_VALUES[name]) for name in free & GIVEN_VALUES.keys()
        }
        namespace |= {name: [next(urls) for _ in range(GIVEN_SERVERS[name])] for name in given}
        hosts = {found["host"] for found in _ANY_URL.finditer(text)}
        assert hosts <= {"127.0.0.1"}, f"{block.where}: a URL that is not a server's: {hosts}"
        with contextlib.redirect_stdout(printed):
            exec(compile(text, block.where, "exec"), namespace)
        unasked = [s.base_url for s in servers if not (s.models_asked or s.requests)]
        answered = sum(len(server.requests) for server in servers)
    assert not unasked, f"{block.where}: servers never asked: {unasked}"
    assert answered or not servers, f"{block.where}: no server was sent a prompt"
    lines = printed.getvalue().splitlines()
    for shown in _shown_output(block.text):
        assert any(_like(shown).fullmatch(line) for line in lines), (
            f"{block.where}: nothing printed like {shown!r}; printed {lines}"
        )


def _toml_statements(text: str) -> list[str]:
    """A TOML fragment's ``key = value`` statements, each with its continuation lines."""
    statements: list[str] = []
    for line in text.splitlines():
        if _TOML_KEY.match(line) or not statements:
            statements.append(line)
        else:
            statements[-1] += "\n" + line
    return [s for s in statements if s.strip() and not s.lstrip().startswith("#")]


def _job_flags(table: dict[str, Any]) -> list[str]:
    """Flags for what ``run`` needs and a job file leaves to the command line."""
    keys = {key.replace("-", "_") for key in table}
    flags = [flag for key, pair in _JOB_FLAGS.items() if key not in keys for flag in pair]
    if not keys & {*SERVER_SETTINGS, "offline_model"}:
        flags += ["--servers", "http://127.0.0.1:8000/v1"]
    return flags


@pytest.mark.parametrize("block", _TOML)
def test_toml_block_loads(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every TOML block is read by the loader of what it is: a pipeline file by
    ``pipeline run``'s, a job file by ``run --config``'s, a step's keys in a step. An
    unknown key, a bad value or a bad ``where`` fails here as it would for a user."""
    monkeypatch.chdir(ROOT)  # the guides' files name paths from the repository's root
    file = tmp_path / "block.toml"
    try:
        table: dict[str, Any] | None = tomllib.loads(block.text)
    except tomllib.TOMLDecodeError:
        table = None  # keys of a step, say two alternatives of one key
    if table is not None and "steps" in table:
        file.write_text(block.text, encoding="utf-8")
        assert load_pipeline(file).pipeline.steps, block.where
    elif table is not None and not {k.replace("-", "_") for k in table} & _STEP_ONLY:
        file.write_text(block.text, encoding="utf-8")
        args = _parser().parse_args(["run", "--config", str(file), *_job_flags(table)])
        assert settings_from(args), block.where
    else:
        statements = _toml_statements(block.text)
        assert statements, f"{block.where}: no keys"
        for statement in statements:
            file.write_text(
                'output_dir = "runs/fragment"\n'
                'servers = ["http://127.0.0.1:8000/v1"]\n'
                "[steps.fragment]\n"
                'input = "reviews.jsonl"\n'
                'prompt_template = "{text}"\n'
                f"{statement}\n",
                encoding="utf-8",
            )
            assert load_pipeline(file).pipeline.steps, f"{block.where}: {statement}"
