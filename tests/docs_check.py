"""Reading the docs (README.md and docs/) as the test of documented commands sees them.

What a fenced block is, by its info string (the words after the opening fence):

* ``sh``, ``bash``, ``shell``: commands. Each line (``\\`` continuations joined, ``#`` comments
  dropped, ``VAR=value`` prefixes set aside) is run as far as it can be without doing the work:
  ``hicache ...`` and ``python benchmarks/X.py ...`` go through their real argument parsers and
  stop once the arguments parsed; ``make T ...`` must dry-run (``make -n``), and the ``hicache`` or
  benchmark command its recipe runs is parsed the same way; ``python -c CODE`` is compiled;
  ``pip install 'hicache[a,b]'`` must name extras of pyproject.toml; ``export`` is allowed. Any
  other program fails the check: a block that cannot run here says so with ``not-run: REASON``
  after the language (``sh not-run: starts a server``), and is then only checked by ``bash -n``
  (and its JSON arguments must parse).
* ``text``: usages. A line starting with ``hicache`` must name existing subcommands and options.
* ``python``: compiled (top-level ``await`` allowed), and every ``hicache`` import must resolve;
  ``python run`` blocks are run, from the repository root, in a fresh interpreter.
* ``yaml``: hicache configuration, validated by ``hicache config``. A ``tiers.storage`` item (or a
  list of them) stands for ``tiers.storage``; ``${VAR}`` without a default gets a stand-in value.
  A block right after a line that names a file of the repository ("`config/vllm.yaml`:") must load
  to the same configuration as that file. ``yaml not-run: REASON`` for YAML that is not a config.
* ``json``: must parse. Other languages (``promql``, ...) are read by people only; a fence with no
  language at all is an error, so each block says what it is.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import runpy
import shlex
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
SHELLS = {"sh", "bash", "shell"}
CHECKED = SHELLS | {"text", "python", "yaml", "json"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --------------------------------------------------------------------------- blocks and prose


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    directive: str  # the rest of the info string: "", "run", "not-run: why"
    text: str  # dedented to the fence's indentation
    before: str  # the last non-empty line of prose before the fence

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        m = re.match(r"not-run:\s*(.*)", self.directive)
        return m.group(1).strip() if m else None


_FENCE = re.compile(r"^(\s*)(```+)\s*(.*?)\s*$")


def split_markdown(text: str, path: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a page, and its prose as (line number, line) outside them."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    before = ""
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            if lines[i].strip():
                before = lines[i].strip()
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3)
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[i]):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1  # the closing fence
        lang, _, directive = info.partition(" ")
        blocks.append(Block(path, start + 1, lang.lower(), directive.strip(), "\n".join(body) + "\n", before))
    return blocks, prose


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in split_markdown(p.read_text(encoding="utf-8"), p)[0]]


def inline_spans(path: Path) -> list[tuple[int, str]]:
    """Inline code spans of a page's prose (a span may wrap a line), with the line it starts on."""
    _, prose = split_markdown(path.read_text(encoding="utf-8"), path)
    spans = []
    paragraph: list[tuple[int, str]] = []
    for n, line in [*prose, (0, "")]:
        if line.strip():
            paragraph.append((n, line))
            continue
        if paragraph:
            text = "\n".join(l for _, l in paragraph)
            for m in re.finditer(r"(`+)(.+?)\1", text, re.S):
                first = paragraph[0][0] + text[: m.start()].count("\n")
                spans.append((first, " ".join(m.group(2).split())))
            paragraph = []
    return spans


# --------------------------------------------------------------------------- anchors (GitHub's rules)


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    _, prose = split_markdown(path.read_text(encoding="utf-8"), path)
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """Relative links and images of a page's prose (not inside code)."""
    out = []
    for n, line in split_markdown(path.read_text(encoding="utf-8"), path)[1]:
        line = re.sub(r"`[^`]*`", "", line)
        for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            target = m.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                out.append((n, target))
    return out


def broken_link(path: Path, target: str) -> str | None:
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.exists():
        return f"{target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: no heading #{anchor} in {rel(dest)}"
    return None


# --------------------------------------------------------------------------- running parsers, not programs


class _Parsed(Exception):
    """Raised in place of running a program once its arguments parsed (or to hand back its parser)."""

    def __init__(self, parser: argparse.ArgumentParser | None = None) -> None:
        self.parser = parser


@contextlib.contextmanager
def _stop_at_parse(*, parse: bool) -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        if parse:
            original(self, args, namespace)  # a bad argument: SystemExit(2), the message on stderr
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        yield


def _call(program: Callable[[], Any], *, parse: bool = True) -> tuple[str | None, argparse.ArgumentParser | None]:
    """(error or None, the parser) of running ``program`` up to its argument parsing."""
    err = io.StringIO()
    try:
        with _stop_at_parse(parse=parse), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            program()
    except _Parsed as parsed:
        return None, parsed.parser
    except SystemExit as exc:
        if exc.code in (0, None):  # --help
            return None, None
        return f"exit {exc.code}: {err.getvalue().strip()[-600:]}", None
    return "it returned without parsing its arguments", None


def hicache_main() -> Callable[[list[str]], Any]:
    """The ``hicache`` console script, as pyproject.toml declares it."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["hicache"]
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def parse_hicache(args: list[str]) -> str | None:
    main = hicache_main()
    return _call(lambda: main(list(args)))[0]


def _run_script(script: Path, args: list[str]) -> None:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def parse_script(script: str, args: list[str]) -> str | None:
    path = ROOT / script
    if not path.is_file():
        return f"{script}: no such file"
    return _call(lambda: _run_script(path, args))[0]


def hicache_options(words: list[str]) -> tuple[str | None, set[str]]:
    """The options a ``hicache`` command path may take: its own, its parents' and its subcommands'."""
    main = hicache_main()
    error, parser = _call(lambda: main(words[:1] or ["--help"]), parse=False)
    if parser is None:
        return error or "no parser", set()
    top_choices = _subcommands(parser)
    path = words if words[:1] and words[0] in top_choices else words[1:]
    options: set[str] = set()
    for word in path:
        options |= _own_options(parser)
        sub = _subcommands(parser)
        if word not in sub:
            return f"hicache {' '.join(words)}: no subcommand {word!r} (has {sorted(sub)})", set()
        parser = sub[word]
    return None, options | _all_options(parser)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update(action.choices)
    return out


def _own_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _all_options(parser: argparse.ArgumentParser) -> set[str]:
    out = _own_options(parser)
    for sub in _subcommands(parser).values():
        out |= _all_options(sub)
    return out


# --------------------------------------------------------------------------- shell lines


def shell_lines(text: str) -> list[str]:
    """Logical command lines: ``\\`` continuations joined, and a quoted string that spans lines kept whole."""
    joined, current = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        try:
            words_of(current)
        except ValueError:  # "No closing quotation": the string goes on on the next line
            current += "\n"
            continue
        joined.append(current)
        current = ""
    if current:
        joined.append(current)
    return [line for line in joined if line.strip() and not line.lstrip().startswith("#")]


def words_of(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def strip_env(words: list[str]) -> list[str]:
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    return words[i:]


def pyproject_extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
