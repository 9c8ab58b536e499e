"""Fuzzing ``load_config`` with YAML documents and environment variables (issue 11, the fuzz suite).

Documents are drawn three ways: near-valid configs with random values in every field (so validation
runs deep, into each storage backend's settings), arbitrary nested YAML, and hostile text (aliases
nested inside each other, self-references, deep nesting, mangled bytes). Environment variables are
drawn over ``HICACHE_*`` paths, with YAML in their values. Secrets (a tenant key, passwords, URL
passwords in every form) are planted in secret positions.

The property: ``load_config`` returns a config or raises ``ConfigError`` (nothing else), within a
bounded time, and no planted secret appears in the error, its chained causes, the traceback, or the
loaded config's repr and YAML dump.
"""

from __future__ import annotations

import string
import time
import traceback
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from hicache import load_config
from hicache.errors import ConfigError

from .conftest import examples

SECRET = "Qx7Zs3cr3tV4lue"  # planted only where secrets go; must never be printed
SECRET_URLS = [
    f"redis://user:{SECRET}@127.0.0.1:6379/0",
    f"redis://:{SECRET}@h@127.0.0.1:1/0",
    f"rediss://u:{SECRET}@host:99999/0",  # a bad port: an error that must not echo the URL's password
    f"unix://:{SECRET}@/run/x.sock?db=0",
    f"redis://127.0.0.1/0?password={SECRET}",
    f"http://u:{SECRET}@h/0",
    f"redis://127.0.0.1:port/0?db=x&password={SECRET}",
]
FIELD_NAMES = [
    "model", "name", "num_layers", "num_kv_heads", "head_dim", "dtype", "attention", "revision", "page_size",
    "tenant_salt", "tenant_key", "tiers", "device", "host", "storage", "capacity", "layout", "pin_memory", "kind",
    "path", "fsync", "url", "password", "key_prefix", "timeout_s", "policies", "write", "eviction", "prefetch",
    "io", "backend", "controller", "low_watermark", "high_watermark",
]

texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["512MiB", "1.5GiB", "0", "-1", "1e30", "lots", "${HOME}", "${UNSET_VAR_X}", "${V:-d}", "$${x}",
                     "${1BAD}", "$UNSET_VAR_Y/x", "~/p", "auto", "cuda:0", "true", "null", "mla", "float16", "", " "]),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), texts,
)
keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(string.ascii_lowercase + "_", min_size=1, max_size=8))
nested = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=16,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(strategy, nested)


storage_entries = st.one_of(
    st.fixed_dictionaries(
        {"kind": st.just("file"), "path": maybe(st.sampled_from(["/tmp/hicache-fuzz-never-created/p", "${UNSET_Z}",
                                                                  "$UNSET_Z/p", "/dev/null", "rel/p"]))},
        optional={"capacity": maybe(st.sampled_from(["1GiB", 4096, 0, 1e30])), "fsync": maybe(st.just("never")),
                  "write_threads": maybe(st.integers(-1, 100)), "read_ahead": maybe(st.integers(-1, 300)),
                  "bogus": scalars},
    ),
    st.fixed_dictionaries(
        {"kind": st.just("redis"), "url": maybe(st.sampled_from(SECRET_URLS))},
        optional={"password": st.sampled_from([SECRET, int("20240917"), [SECRET]]), "key_prefix": maybe(texts),
                  "ttl_s": maybe(st.integers(-5, 10)), "username": texts},
    ),
    st.fixed_dictionaries({"kind": st.sampled_from(["memory", "mooncake", "nope", "os:system", ""])},
                          optional={"capacity": scalars, "master": texts}),
)
near_valid = st.fixed_dictionaries(
    {},
    optional={
        "model": st.fixed_dictionaries(
            {}, optional={"name": maybe(texts), "num_layers": maybe(st.integers(-2, 2**40)),
                          "num_kv_heads": maybe(st.integers(0, 8)), "head_dim": maybe(st.integers(0, 256)),
                          "dtype": maybe(st.sampled_from(["float32", "bfloat16", "int8"])),
                          "attention": maybe(st.sampled_from(["mha", "mla"]))}),
        "page_size": maybe(st.one_of(st.integers(-1, 2**24), st.just(True), st.just(1e23))),
        "tenant_key": st.sampled_from([SECRET + "-long-enough", SECRET, int("12345678901234567890"), "**********", ""]),
        "tenant_salt": maybe(texts),
        "tiers": st.fixed_dictionaries(
            {}, optional={"device": st.fixed_dictionaries({}, optional={"capacity": scalars, "device": texts}),
                          "host": st.fixed_dictionaries({}, optional={"capacity": scalars, "layout": texts}),
                          "storage": st.one_of(st.lists(storage_entries, max_size=3), storage_entries)}),
        "policies": maybe(st.dictionaries(st.sampled_from(["write", "eviction", "prefetch", "write_threshold"]),
                                          scalars, max_size=3)),
        "controller": maybe(st.dictionaries(st.sampled_from(["io_threads", "low_watermark", "high_watermark"]),
                                            scalars, max_size=3)),
    },
)


@st.composite
def hostile_text(draw: st.DrawFn) -> str:
    """YAML built as text: aliases nested inside each other, self-references, deep nesting."""
    kind = draw(st.sampled_from(["bomb", "self", "deep", "deep-map", "mangled"]))
    if kind == "bomb":
        levels, width = draw(st.integers(1, 9)), draw(st.integers(2, 9))
        lines = [f"  l0: &l0 [{', '.join(['x'] * width)}]"]
        lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
        where = draw(st.sampled_from(["model", "policies", "tiers"]))
        return f"{where}:\n" + "\n".join(lines) + "\n"
    if kind == "self":
        return draw(st.sampled_from(["a: &a [*a]\n", "tiers: &t {storage: [*t]}\n", "model: &m {name: [*m, *m]}\n"]))
    if kind == "deep":
        depth = draw(st.integers(10, 3000))
        return "model:\n  name: " + "[" * depth + "]" * depth + "\n"
    if kind == "deep-map":
        depth = draw(st.integers(10, 2000))
        return "page_size: " + "{a: " * depth + "1" + "}" * depth + "\n"
    text = yaml.safe_dump(draw(near_valid))
    cut = draw(st.integers(0, len(text)))
    junk = draw(st.text(alphabet="&*!|>:{}[]%@`'\"\t\n -#", max_size=8))
    return text[:cut] + junk + text[cut:]


documents = st.one_of(near_valid.map(yaml.safe_dump), nested.map(yaml.safe_dump), hostile_text())

env_names = st.one_of(
    st.sampled_from(["HICACHE_PAGE_SIZE", "HICACHE_TIERS__STORAGE", "HICACHE_MODEL__NAME",
                     "HICACHE_TIERS__HOST__CAPACITY", "HICACHE_TIERS__DEVICE", "HICACHE_MODEL", "HICACHE_X",
                     "HICACHE_TIERS____HOST", "HICACHE_POLICIES__WRITE", "HICACHE_CONTROLLER__IO_THREADS"]),
    st.text(string.ascii_uppercase + "_", min_size=1, max_size=12).map(lambda s: "HICACHE_" + s),
).filter(lambda name: name != "HICACHE_TENANT_KEY")
env_values = st.one_of(
    texts,
    nested.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()),
    st.sampled_from(["[&a [x, x, x, x], [*a, *a, *a, *a], &b [*a, *a]]",
                     "{a: &a [x, x, x, x, x, x, x, x, x, x], b: &b [" + ", ".join(["*a"] * 10) + "], c: &c ["
                     + ", ".join(["*b"] * 10) + "], d: [" + ", ".join(["*c"] * 20) + "]}",
                     "[" * 500 + "]" * 500, "&a [*a]"]),
)
# Secrets go only where secrets belong: the tenant key, and passwords inside a storage list.
secret_env = st.fixed_dictionaries(
    {},
    optional={
        "HICACHE_TENANT_KEY": st.sampled_from([SECRET + "-long-enough", SECRET, "", "**********"]),
        "HICACHE_TIERS__STORAGE": st.sampled_from(
            [f"[{{kind: redis, password: {SECRET}}}]", f"[{{kind: redis, url: '{SECRET_URLS[0]}'}}]",
             f"[{{kind: redis, url: '{SECRET_URLS[2]}', password: {SECRET}}}]", f"{{kind: redis, password: {SECRET}}}"]
        ),
    },
)
environments = st.tuples(st.dictionaries(env_names, env_values, max_size=4), secret_env).map(
    lambda pair: {**pair[0], **pair[1], "HOME": "/nonexistent-home", "V": "value"}
)


def check(load: Any) -> None:
    start = time.perf_counter()
    try:
        config = load()
    except ConfigError as exc:
        said = "".join(traceback.format_exception(exc))
        assert SECRET not in said, said
    else:
        shown = repr(config) + config.to_yaml()
        assert SECRET not in shown, shown
    # Bounded: the worst inputs (deep flow nesting) take ~0.6 s here; 15 s allows for a loaded machine.
    assert time.perf_counter() - start < 15.0, "load_config took too long"


@examples(250)
@given(text=documents, env=environments)
def test_load_config_on_random_documents_and_environments(tmp_path_factory: Any, text: str, env: dict) -> None:
    path = Path(tmp_path_factory.mktemp("doc")) / "c.yaml"
    path.write_text(text, encoding="utf-8")
    check(lambda: load_config(path, env=env))


@examples(150)
@given(env=environments, overrides=st.one_of(st.none(), near_valid))
def test_load_config_on_random_environments_and_overrides(env: dict, overrides: dict | None) -> None:
    check(lambda: load_config(None, overrides, env=env))
