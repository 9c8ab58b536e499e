"""Every command and config key in README.md and docs/ runs as written; every link lands.

The conventions (what a ``sh``, ``text``, ``python``, ``yaml`` or ``json`` block must do, and the
``not-run: REASON`` marker for commands that cannot run here) are in ``tests/docs_check.py`` and
in docs/development.md. Nothing here does a command's work: programs stop once their arguments
parsed, ``make`` dry-runs, configs are validated, not opened.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from hicache import HiCacheConfig, load_config

from .docs_check import (
    CHECKED,
    ROOT,
    SHELLS,
    Block,
    all_blocks,
    broken_link,
    doc_files,
    hicache_main,
    hicache_options,
    inline_spans,
    links,
    parse_hicache,
    parse_script,
    pyproject_extras,
    rel,
    shell_lines,
    split_markdown,
    strip_env,
    words_of,
)
from .test_make_targets import make

BLOCKS = all_blocks()


def _blocks(*langs: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang in langs]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


# --------------------------------------------------------------------------- commands


def _program(words: list[str]) -> tuple[str, list[str]]:
    """What runs: ("hicache", args), ("script", [path, *args]), ("python-c", [code]), ("make", args), ..."""
    name, args = Path(words[0]).name, words[1:]
    if name == "hicache":
        return "hicache", args
    if re.fullmatch(r"python3?(\.\d+)?", name):
        if args[:2] in (["-m", "hicache"], ["-m", "hicache.cli"]):
            return "hicache", args[2:]
        if args[:2] == ["-m", "pip"]:
            return "pip", args[2:]
        if args[:1] == ["-c"] and len(args) > 1:
            return "python-c", args[1:2]
        if args and args[0].endswith(".py"):
            return "script", args
    if name in ("make", "pip", "export"):
        return name, args
    return "other", words


def check_command(words: list[str], *, via_make: bool = False) -> str | None:
    """None when the command parses as written, else what is wrong."""
    kind, args = _program(words)
    if kind == "hicache":
        return parse_hicache(args)
    if kind == "script":
        return parse_script(args[0], args[1:])
    if kind == "python-c":
        try:
            compile(args[0], "<python -c>", "exec")
        except SyntaxError as exc:
            return f"python -c: {exc}"
        return None
    if kind == "make":
        return _check_make(args)
    if kind == "pip":
        return _check_pip(args)
    if kind == "export":
        return None
    if via_make:
        return None  # a recipe's other lines (installs, pytest): make -n already said they exist
    return f"{words[0]}: not a command this test knows how to check; mark the block `not-run: why`"


def _check_make(args: list[str]) -> str | None:
    if shutil.which("make") is None:
        pytest.skip("needs make")
    dry = make("-n", *args)
    if dry.returncode != 0:
        return f"make -n {' '.join(args)}: {dry.stderr.strip()[-400:]}"
    for line in dry.stdout.splitlines():
        words = strip_env(words_of(line))
        kind = _program(words)[0] if words else ""
        # A script that another environment runs (.venv-sglang's SGLang) cannot import here: make -n
        # is its check. hicache's own CLI parses the same everywhere.
        if kind == "hicache" or (kind == "script" and not words[0].startswith(".venv-")):
            error = check_command(words, via_make=True)
            if error:
                return f"make {' '.join(args)} runs `{line.strip()}`: {error}"
    return None


def _check_pip(args: list[str]) -> str | None:
    if args[:1] != ["install"]:
        return f"pip {' '.join(args)}: only `pip install` of hicache's extras is checked"
    extras = pyproject_extras()
    for arg in args[1:]:
        if arg.startswith("-") or arg == ".":
            continue
        m = re.fullmatch(r"(?:hicache|\.)\[([\w,-]+)\]", arg)
        if not m:
            return f"pip install {arg}: not hicache or one of its extras"
        unknown = set(m.group(1).split(",")) - extras
        if unknown:
            return f"pip install {arg}: no extra {sorted(unknown)} in pyproject.toml (has {sorted(extras)})"
    return None


def _json_arguments(words: list[str]) -> str | None:
    for word in words:
        if word.startswith("{"):
            try:
                json.loads(word)
            except json.JSONDecodeError as exc:
                return f"JSON argument {word[:40]}...: {exc}"
    return None


@pytest.mark.parametrize("block", _blocks(*SHELLS), ids=_ids(_blocks(*SHELLS)))
def test_each_command_runs_as_written(block: Block) -> None:
    bash = shutil.which("bash")
    if bash:
        syntax = subprocess.run([bash, "-n"], input=block.text, capture_output=True, text=True, check=False)
        assert syntax.returncode == 0, f"{block.where}: bash -n: {syntax.stderr}"
    if block.not_run is not None:
        assert block.not_run, f"{block.where}: `not-run:` needs a reason"
    errors = []
    for line in shell_lines(block.text):
        words = strip_env(words_of(line))
        if not words:
            continue
        error = _json_arguments(words)
        if block.not_run is None and error is None:
            if set(words) & {";", "&&", "||", "|", "(", ")", "<", ">"}:
                error = "compound shell lines are not checked; split it, or mark the block `not-run: why`"
            else:
                error = check_command(words)
        if error:
            errors.append(f"`{line.strip()}`: {error}")
    assert not errors, f"{block.where}:\n" + "\n".join(errors)


@pytest.mark.parametrize("block", _blocks("text"), ids=_ids(_blocks("text")))
def test_each_usage_names_real_subcommands_and_options(block: Block) -> None:
    errors = []
    for line in block.text.splitlines():
        words = line.split("#")[0].split()
        if words[:1] != ["hicache"]:
            continue
        path = []
        for w in words[1:]:
            if not re.fullmatch(r"[a-z][a-z-]*", w):
                break
            path.append(w)
        error, options = hicache_options(path)
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", line.split("#")[0]))
        if error:
            errors.append(error)
        elif named - options:
            errors.append(f"`{line.strip()}`: hicache {' '.join(path)} has no {sorted(named - options)}")
    assert not errors, f"{block.where}:\n" + "\n".join(errors)


# --------------------------------------------------------------------------- code and config


def _hicache_imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "hicache"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hicache":
            out.append((node.module, [a.name for a in node.names]))
    return out


def resolve_name(dotted: str) -> str | None:
    """None when ``hicache.a.b`` imports (as a module, or an attribute of one); an engine that is not
    installed here (vLLM, SGLang) is not held against the docs."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] != "hicache":
                return None
            continue
        for attr in parts[cut:]:
            try:
                obj = getattr(obj, attr)
            except ModuleNotFoundError as exc:  # a lazy attribute that imports the engine
                if exc.name and exc.name.split(".")[0] != "hicache":
                    return None
                raise
            except AttributeError:
                return f"{dotted}: {module} has no {'.'.join(parts[cut:])}"
        return None
    return f"{dotted}: no such module"


@pytest.mark.parametrize("block", _blocks("python"), ids=_ids(_blocks("python")))
def test_each_python_block_compiles_and_its_imports_exist(block: Block) -> None:
    tree = compile(block.text, block.where, "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    errors = [e for module, names in _hicache_imports(tree)
              for e in [resolve_name(module), *(resolve_name(f"{module}.{n}") for n in names)] if e]
    assert not errors, f"{block.where}: " + "; ".join(errors)


RUN = [b for b in _blocks("python") if b.directive == "run"]


@pytest.mark.parametrize("block", RUN, ids=_ids(RUN))
def test_each_runnable_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.text)
    env = {**os.environ, "HOME": str(tmp_path), "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode == 0, f"{block.where}:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"


def _as_config(data: object) -> object:
    """A tiers.storage item, or a list of them, stands for tiers.storage."""
    if isinstance(data, list) or (isinstance(data, dict) and "kind" in data):
        return {"tiers": {"storage": data if isinstance(data, list) else [data]}}
    return data


def _stand_ins(text: str) -> dict[str, str]:
    return {name: f"docs-test-{name.lower()}-0123456789" for name in re.findall(r"\$\{([A-Za-z_]\w*)\}", text)}


def validate_yaml(text: str, workdir: Path) -> str | None:
    """None when ``hicache config`` accepts the block (as a config, or as tiers.storage)."""
    data = _as_config(yaml.safe_load(textwrap.dedent(text)))
    if not isinstance(data, dict):
        return f"not a mapping of settings: {type(data).__name__}"
    path = workdir / "block.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = hicache_main()(["config", str(path)])
    return None if code == 0 else f"hicache config: {err.getvalue().strip()}"


YAML = [b for b in _blocks("yaml") if b.not_run is None]


@pytest.mark.parametrize("block", YAML, ids=_ids(YAML))
def test_each_config_block_is_a_valid_config(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _stand_ins(block.text).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(tmp_path))
    error = validate_yaml(block.text, tmp_path)
    assert error is None, f"{block.where}: {error}"
    named = re.fullmatch(r"`([\w./-]+\.ya?ml)`:", block.before)
    if named and (ROOT / named.group(1)).is_file():
        shown = load_config(tmp_path / "block.yaml").to_yaml()
        assert shown == load_config(ROOT / named.group(1)).to_yaml(), \
            f"{block.where}: the block does not load to the same config as {named.group(1)}"


@pytest.mark.parametrize("block", _blocks("json"), ids=_ids(_blocks("json")))
def test_each_json_block_parses(block: Block) -> None:
    json.loads(block.text)


def test_every_block_says_what_it_is() -> None:
    unlabeled = [b.where for b in BLOCKS if not b.lang]
    assert not unlabeled, f"fences without a language (say sh, text, python, yaml, ...): {unlabeled}"
    markers = [b.where for b in BLOCKS if b.directive and b.lang in CHECKED
               and b.directive != "run" and b.not_run is None]
    assert not markers, f"unknown markers after the language (only `run` and `not-run: why`): {markers}"


# --------------------------------------------------------------------------- prose


@pytest.mark.parametrize("page", doc_files(), ids=rel)
def test_every_relative_link_lands(page: Path) -> None:
    errors = [f"{page.name}:{n}: {e}" for n, target in links(page) if (e := broken_link(page, target))]
    assert not errors, "\n".join(errors)


def _field(model: type[BaseModel], path: list[str]) -> str | None:
    """None when ``path`` names a field of ``model`` (or of a model below it)."""
    if not path:
        return None
    name, rest = path[0], path[1:]
    if name not in model.model_fields:
        if model.model_config.get("extra") == "allow":
            return None
        return f"{model.__name__} has no field {name!r}"
    annotation = model.model_fields[name].annotation
    candidates = [annotation, *typing.get_args(annotation)]
    for inner in list(candidates):
        candidates += typing.get_args(inner)
    below = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    if not rest:
        return None
    if not below:
        return f"{name} is a value, not a section (no {'.'.join(rest)})"
    return _field(below[0], rest)


SECTIONS = set(HiCacheConfig.model_fields)


@pytest.mark.parametrize("page", doc_files(), ids=rel)
def test_every_config_key_named_in_the_prose_exists(page: Path) -> None:
    errors = []
    for n, span in inline_spans(page):
        keys = []
        if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", span) and span.split(".")[0] in SECTIONS:
            keys.append(span)
        for env in re.findall(r"\bHICACHE_([A-Z0-9_]+__[A-Z0-9_]+)", span):
            keys.append(env.lower().replace("__", "."))
        for key in keys:
            error = _field(HiCacheConfig, key.split("."))
            if error:
                errors.append(f"{page.name}:{n}: `{span}`: {error}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("page", doc_files(), ids=rel)
def test_every_hicache_name_in_the_prose_exists(page: Path) -> None:
    errors = []
    for n, span in inline_spans(page):
        for name in re.findall(r"(?<![\w.])(hicache(?:\.[A-Za-z_]\w*)+)(?![\w(])", span):
            if span.strip().startswith("pip ") or "=" in span:
                continue
            error = resolve_name(name)
            if error:
                errors.append(f"{page.name}:{n}: `{span}`: {error}")
    assert not errors, "\n".join(errors)


_PACKAGE = ROOT / "src" / "hicache"


def _missing_path(candidate: str) -> str | None:
    candidate = candidate.rstrip("/.,:")
    first = candidate.split("/")[0]
    roots = [r for r in (ROOT, _PACKAGE) if (r / first).is_dir()]
    if "/" not in candidate or not roots:
        return None  # not a path of this repository (another project's file, a placeholder)
    if any((r / candidate).exists() for r in roots):
        return None
    return f"{candidate}: no such file here"


@pytest.mark.parametrize("page", doc_files(), ids=rel)
def test_every_file_the_docs_name_exists(page: Path) -> None:
    errors = []
    for n, span in inline_spans(page):
        for candidate in re.findall(r"(?<![\w/.~$-])(\.?[\w-]+(?:/[\w.-]+)+/?)", span):
            if "://" in span or ": " in span or span.startswith("/") or "{" in candidate:
                continue
            error = _missing_path(candidate)
            if error:
                errors.append(f"{page.name}:{n}: `{span}`: {error}")
    assert not errors, "\n".join(errors)


def _design_tree() -> str:
    page = ROOT / "docs" / "design.md"
    tree = [b for b in split_markdown(page.read_text(), page)[0] if b.text.startswith("src/hicache/")]
    assert len(tree) == 1, "docs/design.md holds one source tree, a `text` block starting with src/hicache/"
    return tree[0].text


def test_the_design_page_lists_every_module_and_only_those() -> None:
    listed: set[str] = set()
    folder = ""
    for line in _design_tree().splitlines()[1:]:
        m = re.match(r"^  (\S+)", line)
        if m:
            head = m.group(1)
            folder = head if head.endswith("/") else ""
            if not head.endswith("/"):
                listed.add(head)
        names = re.findall(r"(?<![\w/])([a-z_0-9]+\.py)\b", line[2 + len(folder):] if m else line)
        listed |= {folder + name for name in names}
    actual = {str(p.relative_to(_PACKAGE)) for p in _PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert not listed - actual, f"docs/design.md lists modules that do not exist: {sorted(listed - actual)}"
    assert not actual - listed, f"docs/design.md does not list: {sorted(actual - listed)}"


# --------------------------------------------------------------------------- the checks can fail


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    assert check_command(["hicache", "bench", "multiturn", "--num-clients", "2"]) is None
    assert "unrecognized arguments" in (check_command(["hicache", "bench", "multiturn", "--no-such-flag"]) or "")
    assert check_command(["hicache", "inspect", "frobnicate", "x.yaml"]) is not None
    assert check_command(["make", "no-such-target"]) is not None
    assert "ARGS" not in (check_command(["make", "run", "ARGS=long-context"]) or "")
    assert check_command(["make", "bench-storage", "ARGS=--fsync sometimes"]) is not None
    assert check_command(["python", "benchmarks/no_such.py"]) is not None
    assert check_command(["pip", "install", "hicache[no-such-extra]"]) is not None
    assert check_command(["vllm", "serve", "model"]) is not None
    assert hicache_options(["inspect", "purge"])[1] >= {"--older-than", "--yes", "--tier"}
    assert validate_yaml("tiers: {host: {capacity: lots}}", tmp_path) is not None
    assert validate_yaml("- {kind: file, path: /tmp/x, no_such_setting: 1}", tmp_path) is not None
    assert validate_yaml("    - kind: file\n      path: /tmp/x\n", tmp_path) is None
    assert _field(HiCacheConfig, ["controller", "alloc_wait_s"]) is None
    assert _field(HiCacheConfig, ["controller", "yield_max_s"]) is not None
    assert resolve_name("hicache.metrics.serve") is None and resolve_name("hicache.metrics.no_such") is not None
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Its part\n\n[ok](#its-part) [bad](#nope) [gone](missing.md)\n")
    assert [broken_link(page, t) is None for _, t in links(page)] == [True, False, False]
