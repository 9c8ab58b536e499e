"""Tests for hicache.config: defaults, layering, size parsing, error messages."""

from __future__ import annotations

import warnings
from pathlib import Path

import pydantic
import pytest

from hicache import load_config  # config.read_config with the composition root's backend resolver
from hicache.config import (
    ControllerConfig,
    HiCacheConfig,
    ModelConfig,
    format_size,
    parse_size,
)
from hicache.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"
KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config_error(*args: object, **kwargs: object) -> str:
    """Run load_config expecting ConfigError; return its message."""
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


# --------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    cfg = HiCacheConfig()
    assert cfg.model.name == "example-model"
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim) == (8, 2, 64)
    assert cfg.model.dtype == "float32" and cfg.model.attention == "mha" and cfg.model.revision == ""
    assert cfg.page_size == 64 and cfg.tenant_salt == ""
    assert cfg.tiers.device.capacity == 256 * MiB and cfg.tiers.device.device == "auto"
    assert cfg.tiers.host.capacity == 2 * GiB
    assert cfg.tiers.host.layout == "page_first" and cfg.tiers.host.pin_memory == "auto"
    assert cfg.tiers.storage == []
    p = cfg.policies
    assert (p.write, p.write_threshold, p.eviction) == ("write_through", 2, "lru")
    assert cfg.io.backend == "kernel" and cfg.io.layerwise is True
    c = cfg.controller
    assert (c.backup_queue, c.load_queue, c.io_threads) == (64, 64, 2)
    assert (c.high_watermark, c.low_watermark, c.shutdown_timeout_s) == (0.95, 0.85, 10.0)


def test_load_without_anything_is_default() -> None:
    assert load_config(env={}) == HiCacheConfig()


def test_default_yaml_matches_model_defaults() -> None:
    assert load_config(CONFIG_DIR / "default.yaml", env={}) == HiCacheConfig()


def test_default_yaml_documents_every_setting() -> None:
    text = (CONFIG_DIR / "default.yaml").read_text(encoding="utf-8")

    def names(model: type[pydantic.BaseModel]) -> set[str]:
        out = set(model.model_fields)
        for field in model.model_fields.values():
            if isinstance(field.annotation, type) and issubclass(field.annotation, pydantic.BaseModel):
                out |= names(field.annotation)
        return out

    missing = {name for name in names(HiCacheConfig) if f"{name}:" not in text}
    assert not missing


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_file_validates(path: Path) -> None:
    cfg = load_config(path, env={})
    assert isinstance(cfg, HiCacheConfig)
    assert cfg.page_bytes > 0


def test_example_files_exist_and_differ_as_documented() -> None:
    names = {p.name for p in CONFIG_DIR.glob("*.yaml")}
    assert names >= {"default.yaml", "write_back.yaml", "mla.yaml", "small.yaml"}
    wb = load_config(CONFIG_DIR / "write_back.yaml", env={})
    assert wb.policies.write == "write_back" and wb.policies.eviction == "lfu"
    assert wb.tiers.host.capacity > HiCacheConfig().tiers.host.capacity
    mla = load_config(CONFIG_DIR / "mla.yaml", env={})
    assert (mla.model.attention, mla.model.num_kv_heads, mla.model.head_dim) == ("mla", 1, 512)
    assert mla.model.dtype == "bfloat16" and mla.model.kv_components == 1
    small = load_config(CONFIG_DIR / "small.yaml", env={})
    assert small.tiers.device.capacity == 8 * MiB and small.tiers.host.capacity == 64 * MiB
    assert small.page_size == 16


# --------------------------------------------------------------------------- derived values


def test_page_bytes_default() -> None:
    assert HiCacheConfig().page_bytes == 2 * 8 * 64 * 2 * 64 * 4 == 524288


def test_page_bytes_mla_bf16() -> None:
    cfg = HiCacheConfig(
        model=ModelConfig(attention="mla", num_kv_heads=1, head_dim=512, num_layers=4, dtype="bfloat16"),
        page_size=16,
    )
    assert cfg.page_bytes == 1 * 4 * 16 * 1 * 512 * 2


@pytest.mark.parametrize(
    ("dtype", "itemsize"), [("float32", 4), ("float16", 2), ("bfloat16", 2), ("float64", 8)]
)
def test_dtype_itemsize_and_torch_dtype(dtype: str, itemsize: int) -> None:
    with warnings.catch_warnings():
        # torch warns at import when numpy is absent; that is the environment, not this module.
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
    model = ModelConfig(dtype=dtype)  # type: ignore[arg-type]
    assert model.itemsize == itemsize
    assert model.torch_dtype == getattr(torch, dtype)
    assert model.torch_dtype.itemsize == itemsize


def test_kv_components() -> None:
    assert ModelConfig().kv_components == 2
    assert ModelConfig(attention="mla", num_kv_heads=1).kv_components == 1


def test_config_is_frozen() -> None:
    cfg = HiCacheConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.page_size = 32  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.tiers.host.capacity = 1  # type: ignore[misc]
    assert cfg.page_size == 64


def test_to_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(CONFIG_DIR / "mla.yaml", {"tiers": {"host": {"capacity": 1536 * MiB}}}, env={})
    text = cfg.to_yaml()
    assert "capacity: 1.5GiB" in text and "capacity: 256MiB" in text
    assert load_config(write(tmp_path, text), env={}) == cfg


def test_storage_tiers_round_trip_through_yaml(tmp_path: Path) -> None:
    tiers = [
        {"kind": "file", "path": "/srv/pages", "capacity": "20GiB", "fsync": "never"},
        {"kind": "memory", "name": "ram"},
    ]
    cfg = load_config(None, {"tiers": {"storage": tiers}}, env={})
    assert [t.tier_name for t in cfg.tiers.storage] == ["file", "ram"]
    assert load_config(write(tmp_path, cfg.to_yaml()), env={}) == cfg


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        (1, 1),
        ("4096", 4096),
        ("100B", 100),
        ("100b", 100),
        ("64KiB", 64 * KiB),
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("1TiB", TiB),
        ("1.5GiB", 1536 * MiB),
        ("0.5KiB", 512),
        ("1GB", 10**9),
        ("1KB", 1000),
        ("2MB", 2 * 10**6),
        ("1TB", 10**12),
        ("512mib", 512 * MiB),
        ("2 GiB", 2 * GiB),
        ("  8 MiB ", 8 * MiB),
        (2048.0, 2048),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    ["lots", "", "MiB", "-1MiB", "1.2.3GiB", "12XB", "0", 0, -5, "1.5B", "0.3KiB", True, None, 1.5, [1]],
)
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size(bad)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (268435456, "256MiB"),
        (2 * GiB, "2GiB"),
        (1536, "1.5KiB"),
        (100, "100B"),
        (10**9, "1GB"),
        (1537, "1537B"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text
    assert parse_size(text) == n


@pytest.mark.parametrize("n", [1, 999, 1023, 1025, 3 * GiB + 1, 7 * MiB + 512, 10**12 + 1024, 5 * TiB])
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n


# --------------------------------------------------------------------------- layering


def test_file_load(tmp_path: Path) -> None:
    path = write(tmp_path, "page_size: 32\ntiers:\n  host:\n    capacity: 1GiB\n")
    cfg = load_config(str(path), env={})
    assert cfg.page_size == 32 and cfg.tiers.host.capacity == GiB
    assert cfg.tiers.host.layout == "page_first"  # sibling default kept
    assert cfg.tiers.device == HiCacheConfig().tiers.device


def test_empty_file_is_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == HiCacheConfig()
    assert load_config(write(tmp_path, "# only a comment\n", "d.yaml"), env={}) == HiCacheConfig()


def test_env_overrides() -> None:
    env = {
        "HICACHE_PAGE_SIZE": "32",
        "HICACHE_TIERS__HOST__CAPACITY": "1GiB",
        "HICACHE_TIERS__DEVICE__CAPACITY": "8388608",
        "HICACHE_MODEL__NAME": "foo",
        "HICACHE_IO__LAYERWISE": "false",
        "HICACHE_CONTROLLER__HIGH_WATERMARK": "0.9",
        "HICACHE_TIERS__HOST__PIN_MEMORY": "true",
    }
    cfg = load_config(env=env)
    assert cfg.page_size == 32
    assert cfg.tiers.host.capacity == GiB and cfg.tiers.device.capacity == 8 * MiB
    assert cfg.model.name == "foo" and cfg.model.num_layers == 8
    assert cfg.io.layerwise is False
    assert cfg.controller.high_watermark == 0.9
    assert cfg.tiers.host.pin_memory is True


def test_env_keeps_strings_for_string_fields() -> None:
    env = {"HICACHE_MODEL__REVISION": "0123", "HICACHE_TENANT_SALT": "1e5", "HICACHE_MODEL__NAME": "null"}
    cfg = load_config(env=env)
    assert cfg.model.revision == "0123" and cfg.tenant_salt == "1e5" and cfg.model.name == "null"


def test_env_list_value() -> None:
    cfg = load_config(env={"HICACHE_TIERS__STORAGE": "[{kind: file, path: /tmp/x}]"})
    assert [(t.kind, t.options) for t in cfg.tiers.storage] == [("file", {"path": "/tmp/x"})]


def test_env_ignores_unrelated_variables() -> None:
    env = {
        "HICACHE_CONFIG": "/nowhere.yaml",
        "HICACHE_REDIS_PASSWORD": "x",
        "HICACHE_": "1",
        "PAGE_SIZE": "3",
        "OTHER": "1",
    }
    assert load_config(env=env) == HiCacheConfig()


def test_precedence_overrides_beat_env_beat_file(tmp_path: Path) -> None:
    path = write(
        tmp_path, "page_size: 16\nmodel: {name: from-file, num_layers: 4}\npolicies: {eviction: fifo}\n"
    )
    env = {"HICACHE_PAGE_SIZE": "32", "HICACHE_MODEL__NAME": "from-env"}
    assert load_config(path, env=env).page_size == 32
    cfg = load_config(path, {"page_size": 128}, env=env)
    assert cfg.page_size == 128  # overrides > env > file
    assert cfg.model.name == "from-env"  # env > file
    assert cfg.model.num_layers == 4  # file > defaults, sibling of an env-set key kept
    assert cfg.policies.eviction == "fifo"


def test_deep_merge_keeps_siblings(tmp_path: Path) -> None:
    path = write(tmp_path, "tiers:\n  host: {capacity: 1GiB, layout: layer_first}\n  device: {device: cpu}\n")
    env = {"HICACHE_TIERS__DEVICE__CAPACITY": "8MiB"}
    cfg = load_config(path, {"tiers": {"host": {"pin_memory": False}}}, env=env)
    host = cfg.tiers.host
    assert host.capacity == GiB and host.layout == "layer_first" and host.pin_memory is False
    assert cfg.tiers.device.device == "cpu" and cfg.tiers.device.capacity == 8 * MiB


def test_lists_are_replaced_whole(tmp_path: Path) -> None:
    path = write(tmp_path, "tiers:\n  storage: [{kind: memory, name: a}, {kind: memory, name: b}]\n")
    cfg = load_config(path, {"tiers": {"storage": [{"kind": "memory", "name": "c"}]}}, env={})
    assert [t.tier_name for t in cfg.tiers.storage] == ["c"]


def test_overrides_does_not_mutate_input() -> None:
    overrides = {"tiers": {"host": {"capacity": "1GiB"}}}
    load_config(None, overrides, env={"HICACHE_TIERS__HOST__LAYOUT": "layer_first"})
    assert overrides == {"tiers": {"host": {"capacity": "1GiB"}}}


# --------------------------------------------------------------------------- substitution


def test_var_substitution(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "tenant_salt: ${SALT}\n"
        "model: {name: 'm-${SUFFIX:-dflt}', revision: '${EMPTY:-r1}'}\n"
        "page_size: ${PS}\n"
        "tiers:\n  storage: [{kind: file, path: '${CACHE_DIR}/x$${LIT}'}]\n",
    )
    env = {"SALT": "tenant-a", "PS": "32", "EMPTY": "", "CACHE_DIR": "/tmp/c"}
    cfg = load_config(path, env=env)
    assert cfg.tenant_salt == "tenant-a"
    assert cfg.model.name == "m-dflt" and cfg.model.revision == "r1"
    assert cfg.page_size == 32
    assert cfg.tiers.storage[0].options == {"path": "/tmp/c/x${LIT}"}


def test_var_substitution_missing_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "tiers:\n  storage:\n    - {kind: file, path: '${HICACHE_PAGES_DIR}'}\n")
    msg = config_error(path, env={})
    assert str(path) in msg
    assert "HICACHE_PAGES_DIR" in msg
    assert "tiers.storage[0].path" in msg


def test_var_substitution_bad_reference(tmp_path: Path) -> None:
    msg = config_error(write(tmp_path, "tenant_salt: '${1BAD}'\n"), env={})
    assert "tenant_salt" in msg and "${1BAD}" in msg


# --------------------------------------------------------------------------- errors


def test_error_messages_name_file_and_fields(tmp_path: Path) -> None:
    text = "tiers:\n  host: {capacity: lots}\n  hots: {}\npolicies: {eviction: random}\n"
    path = write(tmp_path, text, "bad.yaml")
    msg = config_error(path, env={})
    expected = "invalid size 'lots' (expected bytes or a string like '512MiB')"
    assert f"{path}: tiers.host.capacity: {expected}" in msg
    assert f"{path}: policies.eviction: expected one of 'lru', 'lfu', 'fifo', 'priority', 'scan_resistant_lru', got 'random'" in msg
    assert f"{path}: tiers.hots: unknown setting" in msg
    assert len(msg.splitlines()) == 3


def test_error_is_chained_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"page_size": "many"}, env={})
    assert isinstance(info.value.__cause__, pydantic.ValidationError)
    assert "page_size" in str(info.value) and "'many'" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"page_size": 0}, ["page_size", "greater than or equal to 1"]),
        ({"model": {"num_layers": 0}}, ["model.num_layers"]),
        ({"model": {"dtype": "int8"}}, ["model.dtype", "'float32'", "'bfloat16'", "got 'int8'"]),
        ({"model": {"attention": "gqa"}}, ["model.attention", "'mha', 'mla'"]),
        ({"model": "llama"}, ["model: expected a mapping"]),
        ({"model": {"name": ""}}, ["model.name"]),
        ({"policies": {"write": "write_around"}}, ["policies.write", "'write_back'"]),
        ({"policies": {"write_threshold": 0}}, ["policies.write_threshold"]),
        ({"io": {"backend": "dma"}}, ["io.backend", "'kernel', 'direct'"]),
        ({"tiers": {"device": {"device": "tpu"}}}, ["tiers.device.device", "'cuda:N'", "got 'tpu'"]),
        ({"tiers": {"host": {"layout": "row"}}}, ["tiers.host.layout", "'page_first', 'layer_first'"]),
        ({"tiers": {"host": {"pin_memory": "maybe"}}}, ["tiers.host.pin_memory", "'auto', true or false"]),
        ({"tiers": {"device": {"capacity": 0}}}, ["tiers.device.capacity", "at least 1 byte"]),
        ({"tiers": {"storage": "redis"}}, ["tiers.storage", "list"]),
        ({"controller": {"high_watermark": 1.5}}, ["controller.high_watermark"]),
        ({"controller": {"shutdown_timeout_s": 0}}, ["controller.shutdown_timeout_s"]),
        ({"controller": {"io_threads": 0}}, ["controller.io_threads"]),
        ({"controller": {"backup_queue": 0}}, ["controller.backup_queue"]),
        ({"model": {"nmae": "x"}}, ["model.nmae: unknown setting"]),
        ({"bogus": 1}, ["bogus: unknown setting"]),
    ],
)
def test_error_names_field(overrides: dict[str, object], fragments: list[str]) -> None:
    msg = config_error(None, overrides, env={})
    assert msg.startswith("overrides: ")
    for fragment in fragments:
        assert fragment in msg


def test_mla_requires_one_kv_head() -> None:
    msg = config_error(None, {"model": {"attention": "mla", "num_kv_heads": 2}}, env={})
    assert "model.num_kv_heads" in msg and "mla" in msg and "got 2" in msg
    with pytest.raises(pydantic.ValidationError):
        ModelConfig(attention="mla", num_kv_heads=2)
    assert ModelConfig(attention="mla", num_kv_heads=1).num_kv_heads == 1


@pytest.mark.parametrize(("low", "high"), [(0.95, 0.95), (0.9, 0.8)])
def test_watermark_order(low: float, high: float) -> None:
    msg = config_error(None, {"controller": {"low_watermark": low, "high_watermark": high}}, env={})
    assert "controller.low_watermark" in msg and "high_watermark" in msg
    with pytest.raises(pydantic.ValidationError):
        ControllerConfig(low_watermark=low, high_watermark=high)


def test_watermark_order_ok_at_edges() -> None:
    c = ControllerConfig(low_watermark=0.0, high_watermark=1.0)
    assert (c.low_watermark, c.high_watermark) == (0.0, 1.0)


def test_env_error_names_variable() -> None:
    msg = config_error(env={"HICACHE_PAGE_SIZE": "abc"})
    assert "HICACHE_PAGE_SIZE" in msg and "page_size" in msg and "'abc'" in msg
    msg = config_error(env={"HICACHE_TIERS__HOST__CAPACITY": "lots"})
    assert "HICACHE_TIERS__HOST__CAPACITY" in msg and "tiers.host.capacity: invalid size 'lots'" in msg
    msg = config_error(env={"HICACHE_MODEL__NMAE": "x"})
    assert "HICACHE_MODEL__NMAE" in msg and "model.nmae: unknown setting" in msg


def test_env_error_empty_segment() -> None:
    msg = config_error(env={"HICACHE_TIERS____CAPACITY": "1GiB"})
    assert "HICACHE_TIERS____CAPACITY" in msg


def test_error_source_follows_the_layer_that_set_the_value(tmp_path: Path) -> None:
    path = write(tmp_path, "page_size: 0\n")
    msg = config_error(path, {"policies": {"eviction": "random"}}, env={"HICACHE_IO__BACKEND": "dma"})
    assert f"{path}: page_size:" in msg
    assert "overrides: policies.eviction:" in msg
    assert "environment variable HICACHE_IO__BACKEND: io.backend:" in msg


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert config_error(missing, env={}) == f"config file not found: {missing}"


def test_yaml_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "page_size: 32\ntiers:\n  host: {capacity: 1GiB\nio: {}\n")
    msg = config_error(path, env={})
    assert str(path) in msg and "line 4" in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_mapping(tmp_path: Path, text: str) -> None:
    msg = config_error(write(tmp_path, text), env={})
    assert "top level must be a mapping" in msg


def test_overrides_must_be_mapping() -> None:
    assert "overrides" in config_error(None, ["page_size", 3], env={})


def test_storage_tiers_need_a_host_tier() -> None:
    with pytest.raises(ConfigError, match="tiers.host.capacity: storage tiers are written and read through the host"):
        load_config(overrides={"tiers": {"host": {"capacity": 0}, "storage": [{"kind": "memory"}]}}, env={})
    assert load_config(overrides={"tiers": {"host": {"capacity": 0}}}, env={}).tiers.host.capacity == 0


# --------------------------------------------------------------------------- describing vs. building


def test_config_describes_the_composition_root_checks_backend_settings() -> None:
    """config.read_config alone keeps a storage entry's settings as given (it imports no tier);
    hicache.load_config passes the composition root's resolver, so a typo fails at load time, and
    a config built without one fails when the cache builds the tier."""
    from hicache import HiCache
    from hicache.config import read_config

    entry = {"kind": "file", "path": "/tmp/x", "fsink": "never"}
    described = read_config(overrides={"tiers": {"storage": [entry]}}, env={})
    assert described.tiers.storage[0].options == {"path": "/tmp/x", "fsink": "never"}
    assert "overrides: tiers.storage[0].fsink: unknown setting" in config_error(
        overrides={"tiers": {"storage": [entry]}}, env={}
    )
    with pytest.raises(ConfigError, match="fsink"):
        HiCache.from_config(described)
    assert "unknown storage backend 'nope'" in config_error(overrides={"tiers": {"storage": [{"kind": "nope"}]}}, env={})


def test_secrets_the_resolver_names_are_masked_in_dumps_and_reprs() -> None:
    """s3's access_key_id is a SecretStr though not named like a secret: the resolver says so."""
    from hicache.config import read_config

    entry = {"kind": "s3", "bucket": "pages", "access_key_id": "AKIAVISIBLEKEY123", "region": "eu-west-1"}
    resolved = load_config(overrides={"tiers": {"storage": [entry]}}, env={})
    for text in (resolved.to_yaml(), repr(resolved)):
        assert "AKIAVISIBLEKEY123" not in text and "eu-west-1" in text
    # Described only (no resolver): settings named like secrets are still masked.
    described = read_config(overrides={"tiers": {"storage": [{"kind": "x.y:Z", "api_token": "t0ps3cr3t"}]}}, env={})
    assert "t0ps3cr3t" not in described.to_yaml() + repr(described)
    assert described.tiers.storage[0].options["api_token"] == "t0ps3cr3t"
    # Whether a resolver checked an entry does not change what it says.
    assert read_config(overrides={"tiers": {"storage": [entry]}}, env={}) == resolved
