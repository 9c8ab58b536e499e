"""Reading YAML config documents with bounded work, and ``${VAR}`` substitution.

A config file is a few KiB and a few levels deep; a hostile one (aliases nested inside each other,
an alias inside the value it names, thousands of nested brackets) must be a ``ConfigError``, never a
hang, a blown-up memory or a ``RecursionError``: nesting is bounded while composing, and the copy
that expands aliases (the substitution pass) is bounded in depth, values and cycles.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

from .errors import ConfigError

__all__ = ["MAX_DEPTH", "MAX_VALUES", "MAX_YAML_BYTES", "Budget", "copy_tree", "dotted", "load_yaml", "read_yaml",
           "substitute"]

# Bounds on the work a YAML document can cause (a config file is a few KiB, a few levels deep).
MAX_YAML_BYTES = 1024**2
MAX_DEPTH = 32  # nesting of mappings and lists, aliases expanded
MAX_VALUES = 100_000  # values after aliases are expanded (a 470-byte "billion laughs" makes 1e9)


class _YamlTooDeep(Exception):
    pass


class BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` whose (recursive) composer refuses documents nested deeper than ``MAX_DEPTH``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _YamlTooDeep
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document with bounded nesting; ``yaml.YAMLError`` if it is not YAML.

    Too deep a document is a ``ConfigError`` naming ``source``.
    """
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    except (_YamlTooDeep, RecursionError):
        raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
    finally:
        loader.dispose()


def read_yaml(source: str) -> dict[str, Any]:
    try:
        with open(source, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
        text = raw.decode("utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {source}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc}") from exc
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_YAML_BYTES // 1024} KiB; is this a config file?")
    try:
        data = load_yaml(text, source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        # Not chained: PyYAML's own message quotes the offending line, which may hold a secret.
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of settings, got {type(data).__name__}")
    return data


_VAR_RE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Budget:
    """Counts the values a document expands to and the mappings/lists open on the current path."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values = 0
        self.open: set[int] = set()

    def enter(self, value: Any, where: tuple[Any, ...]) -> None:
        self.values += 1
        if self.values > MAX_VALUES:
            raise ConfigError(
                f"{self.source}: expands to more than {MAX_VALUES} values (YAML aliases repeated inside "
                "each other?); write the settings out"
            )
        if len(where) > MAX_DEPTH:
            raise ConfigError(f"{self.source}: {dotted(where[:4])}...: nested more than {MAX_DEPTH} levels deep")
        if id(value) in self.open:
            raise ConfigError(f"{self.source}: {dotted(where)}: a YAML alias refers to a value that contains it")


def copy_tree(value: Any, where: tuple[Any, ...], budget: Budget, leaf: Any = None) -> Any:
    """A tree copy of parsed YAML (aliases become copies), each leaf passed through ``leaf(value, where)``.

    The copy is what makes aliases expensive, so ``budget`` bounds it (values, depth, cycles).
    """
    budget.enter(value, where)
    if isinstance(value, dict | list):
        budget.open.add(id(value))
        try:
            if isinstance(value, dict):
                return {k: copy_tree(v, (*where, k), budget, leaf) for k, v in value.items()}
            return [copy_tree(v, (*where, i), budget, leaf) for i, v in enumerate(value)]
        finally:
            budget.open.discard(id(value))
    return value if leaf is None else leaf(value, where)


def substitute(value: Any, env: Mapping[str, str], source: str, where: tuple[Any, ...], budget: Budget) -> Any:
    """Expand ``${VAR}`` / ``${VAR:-default}`` in string values (``$${`` is a literal ``${``)."""
    return copy_tree(value, where, budget, lambda v, w: _expand(v, env, source, w))


def _expand(value: Any, env: Mapping[str, str], source: str, where: tuple[Any, ...]) -> Any:
    if not isinstance(value, str) or "${" not in value:
        return value

    def expand(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return "${"
        name, has_default, default = match.group(1).partition(":-")
        if not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{source}: {dotted(where)}: invalid variable reference {match.group(0)!r}")
        if env.get(name):
            return env[name]
        if has_default or name in env:
            return default
        raise ConfigError(
            f"{source}: {dotted(where)}: environment variable {name} is not set "
            f"(write ${{{name}:-default}} to give a default)"
        )

    return _VAR_RE.sub(expand, value)


def dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"
