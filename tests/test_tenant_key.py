"""A tenant key makes a shared store safe against its other writers (issue 11, point 1).

Against real stores (a folder, a valkey-server, a mooncake_master), someone with raw write access
but without the key (``tests/hostile.py``'s ``Attacker``) forges a page, replays another prompt's
valid page under this prompt's name, or plants another tenant's page: each is a miss, counted as
corrupt, and removed, so the victim's next ``store`` writes the page again and it is served after.
The codec tests check what the header gives away (nothing a key can be derived from) and that the
secret shows nowhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache import HiCache, HiCacheConfig, load_config
from hicache.config import SECRET_MASK
from hicache.containers import namespace_from_config
from hicache.errors import ConfigError
from hicache.keys import Namespace, TenantKey, as_token_bytes, chain_keys
from hicache.tiers.base import KVGeometry
from hicache.tiers.storage.page_format import (
    _CHECKSUM_AT,
    HEADER_BYTES,
    KEYED_FORMAT_VERSION,
    PageCodec,
    check_stored_page,
)

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, push_to_storage
from .hostile import KEY_A, KEY_B, Attacker, codec_of, read_back, storage_names, tier_entry
from .mooncake_master import start_mooncake
from .servers import ServerProcess, start_valkey

GEOMETRY = KVGeometry(components=2, num_layers=3, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
NS = bytes(range(16))
KEY = bytes(range(16, 32))


# -- the codec -----------------------------------------------------------------------------------


def encoded(codec: PageCodec, key: bytes = KEY, seed: int = 1) -> tuple[memoryview, memoryview]:
    payload = memoryview(np.random.default_rng(seed).integers(0, 256, codec.payload_bytes, dtype=np.uint8))
    header = memoryview(np.zeros(HEADER_BYTES, dtype=np.uint8))
    codec.encode(key, [payload], header)
    return header, payload


def test_keyed_pages_round_trip_and_carry_a_mac() -> None:
    codec = PageCodec(NS, GEOMETRY, TenantKey(KEY_A))
    header, payload = encoded(codec)
    assert codec.check(KEY, header, [payload]) is None
    assert int.from_bytes(bytes(header[8:10]), "little") == KEYED_FORMAT_VERSION == 5  # keyed: AES-GMAC
    payload[7] ^= 1
    assert codec.check(KEY, header, [payload]) == "mac"


def test_the_gmac_takes_a_fresh_nonce_per_write_and_checks_nonce_tag_and_pieces() -> None:
    codec = PageCodec(NS, GEOMETRY, TenantKey(KEY_A))
    first, payload = encoded(codec)
    again, _ = encoded(codec)
    mac = slice(88, 88 + 28)  # after the header fields: the 12-byte nonce, then the 16-byte tag
    assert bytes(first[:88]) == bytes(again[:88]) and bytes(first[mac]) != bytes(again[mac])
    assert codec.check(KEY, again, [payload]) is None
    # The same page handed over in pieces (a layer_first host pool) checks against the same tag.
    cut = [payload[:1000], payload[1000:5000], payload[5000:]]
    assert codec.check(KEY, first, cut) is None
    pieced = memoryview(np.zeros(HEADER_BYTES, dtype=np.uint8))
    codec.encode(KEY, cut, pieced)
    assert codec.check(KEY, pieced, [payload]) is None
    for at in (88, 88 + 11, 88 + 12, 88 + 27):  # the nonce and the tag: any flipped bit is a miss
        forged = memoryview(bytearray(first))
        forged[at] ^= 0x10
        assert codec.check(KEY, forged, [payload]) == "mac"
    # Another tenant's key, or the same key's page of another name: a miss.
    assert codec.check(b"\x09" * 16, first, [payload]) is not None
    assert PageCodec(NS, GEOMETRY, TenantKey(KEY_B)).check(KEY, first, [payload]) is not None


def test_a_keyed_page_of_the_earlier_blake3_format_is_refused_not_misread() -> None:
    codec = PageCodec(NS, GEOMETRY, TenantKey(KEY_A))
    header, payload = encoded(codec)
    old = memoryview(bytearray(header))
    old[8:10] = (2).to_bytes(2, "little")  # format 2: the keyed BLAKE3 MAC of earlier versions
    assert codec.check(KEY, old, [payload]) == "version"
    found = check_stored_page(codec, KEY, bytes(old) + bytes(payload))
    assert found.status == "unverifiable" and "earlier format" in (found.reason or "")


def test_the_header_gives_away_no_seed_and_no_page_key() -> None:
    """Without a key the header carries the namespace digest (the seed of every key chain); with one, neither."""
    tokens = as_token_bytes(make_tokens(8))
    ns = Namespace("m", "", "mha", 3, 2, 8, "float16", 4, tenant_key=TenantKey(KEY_A))
    page_keys = chain_keys(ns.digest, tokens, 4)
    codec = PageCodec(ns.digest, GEOMETRY, ns.tenant_key)
    name = codec.storage_keys(page_keys)[0]
    assert name != page_keys[0]
    header, _ = encoded(codec, name)
    raw = bytes(header)
    for secret in (ns.digest, *page_keys):
        assert secret not in raw
    plain = Namespace("m", "", "mha", 3, 2, 8, "float16", 4)
    assert plain.digest != ns.digest  # the key seeds the chain: nobody without it can compute a page key
    unkeyed = PageCodec(plain.digest, GEOMETRY)
    assert plain.digest in bytes(encoded(unkeyed)[0])  # integrity-only mode: the seed is public


@pytest.mark.parametrize(
    ("writer", "reason"),
    [
        (PageCodec(NS, GEOMETRY, TenantKey(KEY_B)), "namespace"),  # another tenant
        (PageCodec(NS, GEOMETRY), "version"),  # an unkeyed page (valid xxh3 checksum)
        (PageCodec(bytes(16), GEOMETRY, TenantKey(KEY_A)), "namespace"),  # same key, another model
    ],
)
def test_pages_not_made_with_this_key_are_rejected(writer: PageCodec, reason: str) -> None:
    reader = PageCodec(NS, GEOMETRY, TenantKey(KEY_A))
    header, payload = encoded(writer)
    assert reader.check(KEY, header, [payload]) == reason


def test_a_forged_header_with_a_copied_namespace_fails_the_mac() -> None:
    """The header's fields are public; copying them onto other bytes does not make a page."""
    reader = PageCodec(NS, GEOMETRY, TenantKey(KEY_A))
    header, _ = encoded(reader, seed=1)
    _, other_payload = encoded(reader, seed=2)
    assert reader.check(KEY, header, [other_payload]) == "mac"
    header[_CHECKSUM_AT : _CHECKSUM_AT + 32] = bytes(32)
    assert reader.check(KEY, header, [other_payload]) == "mac"


def test_the_secret_shows_nowhere(caplog: pytest.LogCaptureFixture) -> None:
    config = make_config(8, 16, tenant_key=KEY_A)
    assert config.tenant_key is not None and config.tenant_key.get_secret_value() == KEY_A
    ns = namespace_from_config(config)
    texts = [repr(config), str(config), config.to_yaml(), repr(ns), str(ns), repr(ns.tenant_key), repr(codec_of(config))]
    assert all(KEY_A not in t for t in texts)
    assert f"tenant_key: '{SECRET_MASK}'" in config.to_yaml()
    with pytest.raises(TypeError):  # never pickled (into a log, a queue, a crash dump)
        import pickle

        pickle.dumps(ns.tenant_key)
    # the dump is not a way to leak it back in either: the mask is refused as a key
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"tenant_key": SECRET_MASK}, env={})
    assert "mask" in str(info.value)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"env": {"HICACHE_TENANT_KEY": "12345678901234567890"}}, "12345678901234567890"),  # digits stay a string
        ({"yaml": "tenant_key: ${MY_KEY}\n", "env": {"MY_KEY": KEY_B}}, KEY_B),
        ({"yaml": "tenant_key: ${MY_KEY:-}\n", "env": {}}, None),  # optional: empty is no key
    ],
)
def test_tenant_key_from_the_environment(tmp_path: Path, source: dict, expected: str | None) -> None:
    path = None
    if "yaml" in source:
        path = tmp_path / "c.yaml"
        path.write_text(source["yaml"])
    config = load_config(path, env=source["env"])
    got = config.tenant_key.get_secret_value() if config.tenant_key is not None else None
    assert got == expected


@pytest.mark.parametrize("value", [20240917, "too-short", ["a" * 20]])
def test_bad_tenant_keys_are_refused_without_being_echoed(tmp_path: Path, value: object) -> None:
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"tenant_key": value}))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    text = str(info.value) + str(info.value.__cause__)
    assert "tenant_key" in text
    for shown in ("20240917", "too-short", "a" * 20):
        assert shown not in text


# -- against real stores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_valkey(tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mooncake_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    server, settings = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    yield settings
    server.stop()


@pytest.fixture(params=["file", "redis", "mooncake"])
def entry(request: pytest.FixtureRequest, tmp_path: Path) -> dict:
    """A storage tier entry on a real store of each kind, in a place of this test's own."""
    if request.param == "redis":
        return tier_entry("redis", tmp_path=tmp_path, valkey_port=request.getfixturevalue("valkey_server").port)
    if request.param == "mooncake":
        return tier_entry("mooncake", tmp_path=tmp_path, mooncake=request.getfixturevalue("mooncake_settings"))
    return tier_entry("file", tmp_path=tmp_path)


PAGES = 4


def tenant(entry: dict, key: str | None, **overrides: object) -> HiCacheConfig:
    extra = {"tenant_key": key} if key is not None else {}
    return make_config(
        8, 16, tiers={"storage": [entry]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4}, **extra, **overrides,
    )


def tier_stats(cache: HiCache, entry: dict):
    return cache.stats().storage[entry["kind"]]


async def test_forged_page_is_a_miss_and_the_victims_next_store_replaces_it(entry: dict) -> None:
    config = tenant(entry, KEY_A)
    tokens, kv = make_tokens(PAGES * 4, seed=1), make_kv(config, PAGES * 4, seed=1)
    names = storage_names(config, tokens)
    async with HiCache.from_config(config) as cache, Attacker(entry, config.page_bytes) as attacker:
        await cache.store(tokens, kv)
        await push_to_storage(cache)
        assert await attacker.present(names) == PAGES
        # The forger sees the name and the header; it writes its own bytes under them, with a
        # checksum that would pass without a key, and a MAC made with its own key.
        genuine = await attacker.read(names[2])
        chosen = np.full(config.page_bytes, 7, np.uint8)
        for forger in (codec_of(make_config(8, 16)), codec_of(make_config(8, 16, tenant_key=KEY_B))):
            header = np.frombuffer(bytearray(genuine[:HEADER_BYTES]), np.uint8).copy()
            forged = np.zeros(HEADER_BYTES, np.uint8)
            forger.encode(names[2], [memoryview(chosen)], memoryview(forged))
            header[_CHECKSUM_AT:] = forged[_CHECKSUM_AT:]  # genuine fields, the forger's check value
            await attacker.write(names[2], header.tobytes() + chosen.tobytes())

            corrupt = tier_stats(cache, entry).backend.corrupt_pages
            assert await read_back(cache, tokens, kv) == 2 * 4  # the pages before it, never the forged one
            assert tier_stats(cache, entry).backend.corrupt_pages == corrupt + 1
            assert await attacker.present(names[2:3]) == 0  # dropped: it cannot block the real page
            stored = tier_stats(cache, entry).stored_pages
            await cache.store(tokens, kv)  # the victim stores the prompt again: not skipped
            await push_to_storage(cache)
            assert tier_stats(cache, entry).stored_pages == stored + 2
            assert await read_back(cache, tokens, kv) == PAGES * 4
            await push_to_storage(cache)
        assert_consistent(cache)


async def test_replayed_page_of_another_prompt_is_a_miss(entry: dict) -> None:
    config = tenant(entry, KEY_A)
    a, kv_a = make_tokens(PAGES * 4, seed=2), make_kv(config, PAGES * 4, seed=2)
    b, kv_b = make_tokens(PAGES * 4, seed=3), make_kv(config, PAGES * 4, seed=3)
    names_a, names_b = storage_names(config, a), storage_names(config, b)
    async with HiCache.from_config(config) as cache, Attacker(entry, config.page_bytes) as attacker:
        await cache.store(a, kv_a)
        await cache.store(b, kv_b)
        await push_to_storage(cache)
        await attacker.write(names_b[1], await attacker.read(names_a[1]))  # a valid page, the wrong name
        assert await read_back(cache, b, kv_b) == 4
        assert tier_stats(cache, entry).backend.corrupt_pages == 1
        await push_to_storage(cache)
        assert await read_back(cache, a, kv_a) == PAGES * 4  # the original is untouched
        assert_consistent(cache)


async def test_other_tenants_pages_are_misses(entry: dict) -> None:
    """Same model, same prompt, same store: tenant B finds nothing of A's, even copied under B's names."""
    config_a, config_b, config_plain = tenant(entry, KEY_A), tenant(entry, KEY_B), tenant(entry, None)
    tokens, kv = make_tokens(PAGES * 4, seed=4), make_kv(config_a, PAGES * 4, seed=4)
    names_a = storage_names(config_a, tokens)
    async with HiCache.from_config(config_a) as cache_a, Attacker(entry, config_a.page_bytes) as attacker:
        await cache_a.store(tokens, kv)
        await push_to_storage(cache_a)
        for reader in (config_b, config_plain):
            names = storage_names(reader, tokens)
            assert not set(names) & set(names_a)  # another tenant's names are not ours
            async with HiCache.from_config(reader) as cache:
                assert (await cache.lookup(tokens)).tokens == 0  # nothing under our names
                for name, theirs in zip(names, names_a, strict=True):
                    await attacker.write(name, await attacker.read(theirs))  # planted under our names
                assert await read_back(cache, tokens, kv) == 0
                assert tier_stats(cache, entry).backend.corrupt_pages == 1
                assert_consistent(cache)
        assert await read_back(cache_a, tokens, kv) == PAGES * 4  # A's own pages still serve A


async def test_wrong_key_logs_show_no_secret(entry: dict, caplog: pytest.LogCaptureFixture) -> None:
    config_a, config_b = tenant(entry, KEY_A), tenant(entry, KEY_B)
    tokens, kv = make_tokens(PAGES * 4, seed=5), make_kv(config_a, PAGES * 4, seed=5)
    caplog.set_level(logging.DEBUG)
    async with HiCache.from_config(config_a) as cache_a, Attacker(entry, config_a.page_bytes) as attacker:
        await cache_a.store(tokens, kv)
        await push_to_storage(cache_a)
        for name, theirs in zip(storage_names(config_b, tokens), storage_names(config_a, tokens), strict=True):
            await attacker.write(name, await attacker.read(theirs))
        async with HiCache.from_config(config_b) as cache_b:
            assert await read_back(cache_b, tokens, kv) == 0
    assert "failed verification" in caplog.text
    assert KEY_A not in caplog.text and KEY_B not in caplog.text
