"""Hostile or mistaken configuration (issue 11, points 8-11): secrets never echoed, YAML whose
expansion is bounded, typed errors that say what to do, and the gaps validation used to let through."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from hicache import HiCache, load_config
from hicache.cli import main as cli_main
from hicache.errors import ConfigError, HiCacheError, InvalidTokensError

from .conftest import make_config

REPO = Path(__file__).resolve().parent.parent
SECRET = "Zq9@x:Secret@w0rd"  # an '@' and a ':' inside, as passwords have


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def everything_said(exc: BaseException) -> str:
    """The message, the chained causes and the whole traceback a user would see."""
    return "".join(traceback.format_exception(exc))


# -- point 8: secrets ----------------------------------------------------------------------------


def test_a_numeric_password_is_not_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, "tiers:\n  storage:\n    - kind: redis\n      password: 20240917\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "tiers.storage[0].password" in str(info.value)
    assert "20240917" not in everything_said(info.value)


def test_a_tenant_key_of_the_wrong_type_is_not_echoed() -> None:
    number = int("98765432109876543210")
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"tenant_key": number}, env={})
    assert "tenant_key" in str(info.value) and str(number) not in everything_said(info.value)


def test_a_yaml_syntax_error_does_not_quote_a_secret(tmp_path: Path) -> None:
    """PyYAML's own error quotes the offending line; it must not reach the user (not even as a cause)."""
    secret = "Hq4" + "Secret" + "Key0123456789"
    path = write(tmp_path, f"page_size: 16\ntenant_key: {secret}\t }}:>-[*\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "invalid YAML" in str(info.value) and secret not in everything_said(info.value)


# Every form of URL that carries a password which redis-py reads (checked below against its parser).
URLS = [
    f"redis://alice:{SECRET}@127.0.0.1:6379/0",
    f"redis://:{SECRET}@127.0.0.1:6379/0",
    f"rediss://alice:{SECRET}@cache.example:6380/1",
    f"unix://:{SECRET}@/run/valkey.sock?db=0",
    f"redis://127.0.0.1:6379/0?password={SECRET.replace('@', '%40')}",
    f"redis://127.0.0.1:6379/0?db=1&password={SECRET.replace('@', '%40')}",
    f"unix:///run/valkey.sock?db=0&password={SECRET.replace('@', '%40')}",
]


@pytest.mark.parametrize("url", URLS)
def test_url_passwords_are_masked_in_every_form_redis_py_accepts(url: str) -> None:
    from redis.connection import parse_url

    assert parse_url(url).get("password") == SECRET  # redis-py does use it as the password
    config = load_config(overrides={"tiers": {"storage": [{"kind": "redis", "url": url}]}}, env={})
    assert config.tiers.storage[0].options["url"] == url  # the value itself is intact
    for text in (config.to_yaml(), repr(config), str(config), repr(config.tiers.storage[0])):
        assert not any(part in text for part in ("Zq9", "Secret", "w0rd")), text  # not even a part of it
        assert "**********" in text


def test_a_url_password_is_not_echoed_by_a_url_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"tiers": {"storage": [{"kind": "redis", "url": f"redis://a:{SECRET}@h:99999/0"}]}},
                    env={})
    assert "port" in str(info.value) and "Zq9" not in everything_said(info.value)


def test_secrets_inside_a_misplaced_mapping_are_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:  # a mapping where a list belongs: the error shows the input
        load_config(overrides={"tiers": {"storage": {"kind": "redis", "password": SECRET,
                                                     "url": f"redis://a:{SECRET}@h/0"}}}, env={})
    assert "tiers.storage" in str(info.value) and "Zq9" not in everything_said(info.value)


# -- point 9: YAML that would explode --------------------------------------------------------------


def alias_bomb(levels: int, width: int = 9) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [{', '.join(f'*l{i - 1}' for _ in range(width))}]")
    return "tiers:\n  storage:\n    - kind: file\n      path: /tmp/x\n      bomb:\n" + "".join(
        f"        {line}\n" for line in lines
    )


def test_an_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    path = write(tmp_path, alias_bomb(7))  # 9^7 = 4.8 million values once expanded
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert time.perf_counter() - start < 2.0
    assert "expands to more than" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "tiers: &t\n  storage: [*t]\n",  # an alias inside the value it names
        "model: &m {name: *m}\n",
        "model:\n  name: " + "[" * 5000 + "]" * 5000 + "\n",  # deep nesting
        "model:\n  name: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
    ],
    ids=["self-reference-list", "self-reference-map", "deep-lists", "deep-maps"],
)
def test_self_references_and_deep_nesting_are_config_errors(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_an_alias_bomb_in_an_environment_variable_is_refused() -> None:
    bomb = "[" + ", ".join(["&a [x, x, x, x, x, x, x, x]"] + ["*a"] * 5) + "]"
    nested = "{a: &a [x, x, x, x, x, x, x, x, x, x], b: &b [" + ", ".join(["*a"] * 10) + "], c: &c [" + \
        ", ".join(["*b"] * 10) + "], d: &d [" + ", ".join(["*c"] * 10) + "], e: [" + ", ".join(["*d"] * 100) + "]}"
    with pytest.raises(ConfigError):
        load_config(env={"HICACHE_TIERS__STORAGE": nested})
    with pytest.raises(ConfigError):  # small: refused by validation, as before
        load_config(env={"HICACHE_TIERS__STORAGE": bomb})


@pytest.mark.parametrize("text", ["page_size: " + "[" * 3000 + "]" * 3000 + "\n", alias_bomb(9)])
def test_hicache_config_prints_one_line(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["config", str(write(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_hicache_config_shows_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "tiers: &t\n  storage: [*t]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "config", str(path)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: ")


# -- point 10: typed errors that say what to do ----------------------------------------------------


def file_tier(path: str) -> dict:
    return {"tiers": {"storage": [{"kind": "file", "path": path}]}}


def test_a_file_tier_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(ConfigError) as info:
        make_config(8, 16, **file_tier(str(tmp_path / "plain")))
    assert "tiers.storage[0].path" in str(info.value) and "not a folder" in str(info.value)


async def test_a_file_tier_path_that_cannot_be_created_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    config = make_config(8, 16, **file_tier(str(tmp_path / "plain" / "pages")))  # its parent is a file
    with pytest.raises(ConfigError) as info:
        async with HiCache.from_config(config):
            pass
    assert "path" in str(info.value) and "folder" in str(info.value)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:99999/0", "redis://127.0.0.1:port/0"])
def test_a_redis_url_with_a_bad_port_is_refused_when_the_config_loads(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(8, 16, tiers={"storage": [{"kind": "redis", "url": url}]})
    assert "tiers.storage[0].url" in str(info.value) and "port" in str(info.value)


async def test_a_redis_url_with_another_scheme_is_a_typed_error() -> None:
    with pytest.raises(HiCacheError) as info:
        config = make_config(8, 16, tiers={"storage": [{"kind": "redis", "url": "http://127.0.0.1:6379/0"}]})
        async with HiCache.from_config(config):
            pass
    assert "redis" in str(info.value) and "scheme" in str(info.value)


@pytest.mark.parametrize(
    "tokens",
    [torch.empty(8, dtype=torch.int64, device="meta"), torch.arange(8).to_sparse()],
    ids=["meta", "sparse"],
)
async def test_meta_and_sparse_token_tensors_are_invalid_tokens(tokens: torch.Tensor) -> None:
    config = make_config(8, 16)
    async with HiCache.from_config(config) as cache:
        with pytest.raises(InvalidTokensError):
            await cache.lookup(tokens)
        with pytest.raises(InvalidTokensError):
            async with cache.retrieve(tokens):
                pass


@pytest.mark.parametrize(
    "text",
    ["page_size: 1.0e+23\n", "page_size: 1000000000000000\n", "tiers:\n  host: {capacity: 1.0e+30}\n",
     "tiers:\n  device: {capacity: 1.0e+30}\n", "tiers:\n  storage: [{kind: file, path: /tmp/p, capacity: 1.0e+30}]\n"],
)
def test_absurd_sizes_are_refused_at_validation(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        config = load_config(write(tmp_path, text), env={})
        HiCache.from_config(config)
    assert "page_size" in str(info.value) or "capacity" in str(info.value)


# -- point 11: gaps ----------------------------------------------------------------------------------


def test_a_device_tier_smaller_than_one_page_is_refused() -> None:
    page = make_config(8, 16).page_bytes
    with pytest.raises(ConfigError) as info:
        make_config(8, 16, tiers={"device": {"capacity": page - 1}})
    assert "tiers.device.capacity" in str(info.value) and "one page" in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_config(8, 16, tiers={"host": {"capacity": page // 2}})
    assert "tiers.host.capacity" in str(info.value)
    assert make_config(8, 0).tiers.host.capacity == 0  # no host tier: fine


@pytest.mark.parametrize("field", ["page_size: true", "model: {num_layers: true}", "controller: {io_threads: false}"])
def test_booleans_are_not_counts(tmp_path: Path, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, field + "\n"), env={})
    assert "whole number" in str(info.value)


@pytest.mark.parametrize("form", ["${NAME}", "$NAME"])
def test_an_unset_variable_in_a_file_path_is_an_error_not_a_folder(tmp_path: Path, form: str) -> None:
    name = f"HICACHE_TEST_UNSET_{uuid.uuid4().hex[:8].upper()}"
    assert name not in os.environ
    path = str(tmp_path / form.replace("NAME", name) / "pages")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, yaml.safe_dump(file_tier(path))), env=dict(os.environ))
    assert name in str(info.value) and "not set" in str(info.value)
    assert not any("$" in p.name for p in tmp_path.iterdir())
