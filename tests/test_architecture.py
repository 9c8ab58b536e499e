"""The drawing of the house: imports as arrows, read from the source, must have no circle and must
keep the layers (README "How it is built"). The benchmark scripts are part of the house too.

Every import counts: typing-only (``if TYPE_CHECKING:``), function-level ones and ``__import__("name")``
or ``importlib.import_module("name")`` are still arrows a reader has to follow. ``from package import
name`` is an arrow to the submodule ``name`` when there is one, else to the package's ``__init__``
(whose re-exports then count too). ``benchmarks/`` is a folder of scripts, each run as
``python benchmarks/X.py``, so its modules import one another by their bare names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# The core: the cache, its config and composition root, the tiers, policies, controller and io.
CORE = (
    "hicache.cache", "hicache.config", "hicache.config_yaml", "hicache.containers", "hicache.errors", "hicache.keys",
    "hicache.leases", "hicache.logs", "hicache.radix_tree", "hicache.redaction", "hicache.stats",
    "hicache.controller", "hicache.io", "hicache.policies", "hicache.tiers",
)
# What sits on top of the core: engines, integrations, command lines, benchmarks, operations tools.
EDGES = (
    "hicache.integrations", "hicache.engine", "hicache.cli", "hicache.bench", "hicache.soak", "hicache.inspect",
    "hicache.metrics", "hicache.demo",
)


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def dynamic_imports(tree: ast.AST) -> list[ast.Call]:
    """``__import__(...)`` and ``importlib.import_module(...)`` calls: imports a reader could miss."""
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
                isinstance(f, ast.Attribute) and f.attr == "import_module"
            ):
                calls.append(node)
    return calls


def named(call: ast.Call) -> str | None:
    """The module a dynamic import names as a literal, else None (the arrow cannot be read)."""
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports: in-package modules by name, anything else by its top-level package."""
    mods = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets.update(t for t in map(named, dynamic_imports(tree)) if t and not t.startswith("."))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in mods else module)
        resolved = set()
        for target in targets:
            if target in mods:
                resolved.add(target)
            elif target.split(".")[0] in {n.split(".")[0] for n in mods}:
                # ``import hicache.x.y`` of a module path: the longest in-package prefix
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target:
                    resolved.add(target)
            else:
                resolved.add(target.split(".")[0])
        resolved.discard(name)
        graph[name] = resolved
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue  # outside the package
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return imports(SRC)


@pytest.fixture(scope="module")
def bench_graph() -> dict[str, set[str]]:
    return imports(BENCHMARKS)


def test_the_reader_finds_typing_only_and_function_level_circles(tmp_path: Path) -> None:
    """The check itself can fail: a loop through a TYPE_CHECKING import and a lazy one is a circle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nclass A: ...\n"
    )
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("from pkg import A\n")  # through the package's re-export
    assert circles(imports(tmp_path)) == [["pkg", "pkg.a", "pkg.b", "pkg.c"]]


def test_the_reader_follows_scripts_that_run_one_another(tmp_path: Path) -> None:
    """The check can fail on a folder of scripts: a script that runs another through ``__import__``
    while that one borrows a helper back is a circle; a shared helper module breaks it."""
    (tmp_path / "main.py").write_text('def main(argv):\n    return __import__("axis").main(argv)\n')
    (tmp_path / "axis.py").write_text("def main(argv):\n    from main import helper\n")
    (tmp_path / "other.py").write_text('import importlib\nimportlib.import_module("axis")\n')
    assert imports(tmp_path)["other"] == {"axis", "importlib"}
    assert circles(imports(tmp_path)) == [["axis", "main"]]
    (tmp_path / "axis.py").write_text("from common import helper\ndef main(argv): ...\n")
    (tmp_path / "common.py").write_text("import os\ndef helper(): ...\n")
    assert circles(imports(tmp_path)) == []


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    assert circles(graph) == []


def test_no_import_circles_among_the_benchmarks(bench_graph: dict[str, set[str]]) -> None:
    assert circles(bench_graph) == []


def test_the_benchmarks_name_what_they_import_at_run_time() -> None:
    """A script that picks another by a computed name hides the arrow from this drawing: name it."""
    hidden = {
        (name, ast.unparse(call)) for name, path in modules(BENCHMARKS).items()
        for call in dynamic_imports(ast.parse(path.read_text(encoding="utf-8"))) if named(call) is None
    }
    assert not hidden


def test_hicache_never_imports_the_benchmarks_or_the_tests(graph: dict[str, set[str]]) -> None:
    """The benchmarks sit on hicache (and borrow the tests' server launchers); nothing points back."""
    above = set(modules(BENCHMARKS)) | {"benchmarks", "tests"}
    assert {(m, t) for m, ts in graph.items() for t in ts if t.split(".")[0] in above} == set()


def test_tiers_and_policies_never_import_the_controller(graph: dict[str, set[str]]) -> None:
    bad = {
        (m, t) for m, ts in graph.items() if within(m, ("hicache.tiers", "hicache.policies"))
        for t in ts if within(t, ("hicache.controller", "hicache.cache", "hicache.containers"))
    }
    assert not bad


def test_the_core_never_imports_what_sits_on_it(graph: dict[str, set[str]]) -> None:
    bad = {(m, t) for m, ts in graph.items() if within(m, CORE) for t in ts if within(t, EDGES)}
    assert not bad


def test_only_the_composition_root_imports_dependency_injector(graph: dict[str, set[str]]) -> None:
    assert {m for m, ts in graph.items() if "dependency_injector" in ts} == {"hicache.containers"}


def test_config_describes_keys_and_stats_take_values(graph: dict[str, set[str]]) -> None:
    """config imports no tier (the composition root resolves backend kinds); keys and stats name no config."""
    inside = {m: {t for t in ts if t.startswith("hicache")} for m, ts in graph.items()}
    assert inside["hicache.config"] <= {
        "hicache.errors", "hicache.config_yaml", "hicache.redaction", "hicache.layer_kinds"
    }
    assert inside["hicache.keys"] <= {"hicache.errors"}
    assert inside["hicache.stats"] == set()
    assert "hicache.containers" not in inside["hicache.cache"]


def test_only_the_residency_rule_asks_the_write_policy() -> None:
    """Which copies a page is owed is decided in one place (controller/residency.py), asked once per
    store, commit or hit by the controller; the facade and the other parts never ask the policy."""
    asks = {"backup_on_insert", "backup_on_hit", "store_on_host", "promises_lower", "spill_on_evict"}
    askers = set()
    for name, path in modules(SRC).items():
        if within(name, ("hicache.policies",)):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in asks:
                askers.add(name)
    assert askers == {"hicache.controller.residency"}
