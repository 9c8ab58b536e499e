"""Codec chains per storage tier (issue 26), on every storage backend with its real server.

Each chain is written and read through a real ``StorageTier`` over each backend of the contract suite
(``test_storage_backends.backend_factory``: memory, a folder, Valkey, a Valkey Cluster, Mooncake,
SeaweedFS's S3): round trips are exact (lossless, aes-gcm) or close (int8); a flipped byte, a page
sealed under another key, a page with a stage the reader does not know, and a quantised page asked
for by an exact reader are all misses, counted, never KV handed over.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hicache import load_config
from hicache.config import CodecConfig
from hicache.errors import ConfigError
from hicache.keys import TenantKey
from hicache.tiers.base import KVGeometry
from hicache.tiers.host import HostPool
from hicache.tiers.storage import HEADER_BYTES, PageIO, StorageBackend
from hicache.tiers.storage.codecs import build_chain
from hicache.tiers.storage.page_format import PageCodec, check_stored_page, parse_header
from hicache.tiers.storage.tier import StorageTier

from .test_storage_backends import BackendFactory, backend_factory  # noqa: F401 - the fixture

NS = bytes(range(16))
PAGES = 3
GEOMETRY = KVGeometry(2, 2, 16, 2, 32, torch.bfloat16)  # 8 KiB pages
KEY_A, KEY_B = "codec-key-a-0123456789", "codec-key-b-9876543210"


def codec(*stages: object, tenant: str | None = None, geometry: KVGeometry = GEOMETRY) -> PageCodec:
    entries = [CodecConfig.model_validate(s) for s in stages]
    key = TenantKey(tenant) if tenant else None
    secret = key.derive("page-aead") if key is not None else None
    chain = build_chain(entries, geometry=geometry, namespace=NS, tenant_secret=secret)
    return PageCodec(NS, geometry, key, chain=chain)


async def host_pool(layout: str = "page_first", geometry: KVGeometry = GEOMETRY) -> HostPool:
    host = HostPool(geometry, PAGES * geometry.page_bytes, layout=layout, pin_memory=False)
    await host.open()
    host.buffer.view(-1).copy_(torch.randn(host.buffer.numel(), generator=torch.Generator().manual_seed(0)))
    return host


def page_keys() -> list[bytes]:
    return [bytes([i]) * 16 for i in range(1, PAGES + 1)]


CHAINS = {
    "lossless": (("lossless",), None),
    "int8+lossless": (("int8", "lossless"), None),
    "aes-gcm (tenant key)": (("aes-gcm",), KEY_A),
    "lossless+aes-gcm (own key)": (("lossless", {"kind": "aes-gcm", "key": KEY_B}), None),
}


async def stored_blob(backend: StorageBackend, name: bytes, room: int) -> bytearray:
    buf = bytearray(room)
    sizes = [0]
    io = PageIO.of(memoryview(buf)[:HEADER_BYTES], memoryview(buf)[HEADER_BYTES:])
    assert await backend.get([name], [io], sizes=sizes) == 1
    return buf[: sizes[0]]


async def put_blob(backend: StorageBackend, name: bytes, blob: bytes | bytearray) -> None:
    view = memoryview(bytes(blob))
    assert await backend.set([name], [PageIO.of(view[:HEADER_BYTES], view[HEADER_BYTES:])]) == 1


@pytest.mark.parametrize("chain", list(CHAINS))
async def test_round_trip_and_tamper_on_every_backend(backend_factory: BackendFactory, chain: str) -> None:  # noqa: F811
    stages, tenant = CHAINS[chain]
    c = codec(*stages, tenant=tenant)
    host = await host_pool()
    saved = host.buffer.clone()
    keys = page_keys()
    async with StorageTier("t", backend_factory(), c, host, batch_pages=2) as tier:
        assert await tier.store(keys, list(range(PAGES))) == PAGES
        host.buffer.zero_()
        assert await tier.fetch(keys, list(range(PAGES))) == PAGES
        if "int8" in chain:
            err = (host.buffer.float() - saved.float()).norm() / saved.float().norm()
            assert 0 < err < 0.01
        else:
            assert torch.equal(host.buffer.view(torch.uint8), saved.view(torch.uint8))
        stats = tier.stats().codec
        assert stats.stages == c.chain.names and stats.decoded_pages == stats.encoded_pages == PAGES
        assert stats.encoded_stored_bytes < stats.encoded_logical_bytes or "aes" in chain
        # Someone with write access flips one byte of the second page's stored payload.
        name = c.storage_keys(keys)[1]
        room = HEADER_BYTES + c.max_stored_bytes
        blob = await stored_blob(tier.backend, name, room)
        blob[HEADER_BYTES + len(blob[HEADER_BYTES:]) // 2] ^= 0x10
        await put_blob(tier.backend, name, blob)
        host.buffer.zero_()
        assert await tier.fetch(keys, list(range(PAGES))) == 1  # the page before it is served, not it
        assert tier.backend.stats().corrupt_pages == 1 and tier.stats().codec.failed_pages == 1
        assert await tier.exists(keys) == 1  # the bad page was removed: the next store writes it again


async def test_a_page_sealed_under_another_key_is_a_miss(backend_factory: BackendFactory) -> None:  # noqa: F811
    """Another key's page, as it is (another namespace) or with our header copied onto it (the
    AEAD tag fails): misses, and nothing of its plaintext reaches a served page."""
    mine, theirs = codec("aes-gcm", tenant=KEY_A), codec({"kind": "aes-gcm", "key": KEY_B})
    host = await host_pool()
    keys = page_keys()[:1]
    backend = backend_factory()
    async with StorageTier("mine", backend, mine, host, batch_pages=2) as tier:
        other = StorageTier("theirs", backend, theirs, host, batch_pages=2)
        assert await other.store(keys, [0]) == 1 and await tier.store(keys, [1]) == 1
        room = HEADER_BYTES + mine.max_stored_bytes
        name, their_name = mine.storage_keys(keys)[0], theirs.storage_keys(keys)[0]
        assert name != their_name  # another key, another namespace: never the same names
        own, foreign = await stored_blob(backend, name, room), await stored_blob(backend, their_name, room)
        await put_blob(backend, name, foreign)  # their page, as it is, under my name
        assert await tier.fetch(keys, [2]) == 0
        await put_blob(backend, name, own[:HEADER_BYTES] + foreign[HEADER_BYTES:])  # my header, their ciphertext
        assert await tier.fetch(keys, [2]) == 0
        assert backend.stats().corrupt_pages == 2


async def test_an_exact_reader_never_gets_a_quantised_page(backend_factory: BackendFactory) -> None:  # noqa: F811
    lossy, exact = codec("int8"), PageCodec(NS, GEOMETRY)
    host = await host_pool()
    keys = page_keys()
    backend = backend_factory()
    async with StorageTier("lossy", backend, lossy, host, batch_pages=2) as tier:
        reader = StorageTier("exact", backend, exact, host, batch_pages=2)
        assert await tier.store(keys, list(range(PAGES))) == PAGES
        assert await reader.exists(keys) == 0  # other names
        # Copied under the exact names, a quantised page is not a page of that namespace either.
        room = HEADER_BYTES + lossy.max_stored_bytes
        for name, exact_name in zip(lossy.storage_keys(keys), exact.storage_keys(keys), strict=True):
            await put_blob(backend, exact_name, await stored_blob(backend, name, room))
        assert await reader.fetch(keys, list(range(PAGES))) == 0
        # ... nor, with the exact page's size faked by padding, one it would check as valid.
        blob = await stored_blob(backend, lossy.storage_keys(keys)[0], room)
        padded = bytes(blob) + bytes(HEADER_BYTES + exact.payload_bytes - len(blob))
        await put_blob(backend, exact.storage_keys(keys)[0], padded)
        assert await reader.fetch(keys[:1], [0]) == 0


async def test_a_stage_the_reader_does_not_know_is_a_miss() -> None:
    from hicache.tiers.storage.memory import MemoryBackend

    c = codec("lossless")
    host = await host_pool()
    keys = page_keys()[:1]
    async with StorageTier("t", MemoryBackend(), c, host, batch_pages=2) as tier:
        assert await tier.store(keys, [0]) == 1
        name = c.storage_keys(keys)[0]
        blob = await stored_blob(tier.backend, name, HEADER_BYTES + c.max_stored_bytes)
        assert parse_header(blob).codecs == ("lossless",)
        blob[88] = 0x7F  # the header's first codec id: a stage of a later version
        await put_blob(tier.backend, name, blob)
        assert await tier.fetch(keys, [1]) == 0
        assert c.decode_page(name, memoryview(blob)[:HEADER_BYTES], memoryview(blob)[HEADER_BYTES:],
                             [memoryview(bytearray(c.payload_bytes))]) == "codec"


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_layouts_and_fp32(layout: str) -> None:
    from hicache.tiers.storage.memory import MemoryBackend

    g = KVGeometry(2, 2, 64, 2, 64, torch.float32)  # 64 tokens x 64 dims: scales cost 1/32 each
    c = codec("int8", geometry=g)
    host = await host_pool(layout, g)
    saved = host.page_major().clone()
    async with StorageTier("t", MemoryBackend(), c, host, batch_pages=2) as tier:
        assert await tier.store(page_keys(), list(range(PAGES))) == PAGES
        host.buffer.zero_()
        assert await tier.fetch(page_keys(), list(range(PAGES))) == PAGES
        assert torch.allclose(host.page_major(), saved, atol=0.05)
        st = tier.stats().codec
        assert st.encoded_logical_bytes / st.encoded_stored_bytes >= 3.8  # fp32: 4 bytes -> 1 + scales


def test_int8_ratio_on_bf16_pages_of_64_tokens() -> None:
    g = KVGeometry(2, 30, 64, 3, 64, torch.bfloat16)  # SmolLM2's geometry
    assert g.page_bytes / codec("int8", geometry=g).max_stored_bytes >= 1.9


def test_inspect_verifies_pages_of_a_chain() -> None:
    c = codec("lossless", tenant=KEY_A)
    payload = memoryview(np.random.default_rng(1).standard_normal(GEOMETRY.page_bytes // 4).astype(np.float32))
    name = c.storage_keys([bytes(16)])[0]
    header, stored = c.encode_page(name, [payload.cast("B")])
    blob = header + bytes(stored)
    assert check_stored_page(c, name, blob).status == "ok"
    other = codec("lossless", tenant=KEY_B)
    assert check_stored_page(other, name, blob).status == "unverifiable"
    bad = bytearray(blob)
    bad[-1] ^= 1
    assert check_stored_page(c, name, bytes(bad)).reason == "mac"
    unkeyed = codec("lossless")
    n2 = unkeyed.storage_keys([bytes(16)])[0]
    h2, s2 = unkeyed.encode_page(n2, [payload.cast("B")])
    assert check_stored_page(PageCodec(NS, GEOMETRY), n2, h2 + bytes(s2)).status == "ok"  # self-describing checksum


def test_config_codec_lists() -> None:
    base = {"tiers": {"storage": [{"kind": "memory"}]}}
    config = load_config(overrides={"tenant_key": KEY_A, "tiers": {"storage": [
        {"kind": "memory", "codec": ["int8", {"kind": "lossless", "coder": "lz4"}, "aes-gcm"]}]}}, env={})
    assert [c.kind for c in config.tiers.storage[0].codec] == ["int8", "lossless", "aes-gcm"]
    assert "codec" not in load_config(overrides=base, env={}).to_yaml()  # tiers without codecs dump as before
    for bad, message in (
        (["lossless", "int8"], "order"),
        (["lossless", "lossless"], "at most once"),
        ([{"kind": "int8", "key": KEY_B}], "not a setting"),
        (["aes-gcm"], "needs a key"),
        ([{"kind": "aes-gcm", "key": "**********"}], "mask"),
        (["zip"], "expected one of"),
    ):
        with pytest.raises(ConfigError, match=message) as info:
            load_config(overrides={"tiers": {"storage": [{"kind": "memory", "codec": bad}]}}, env={})
        assert KEY_B not in str(info.value)
    with_key = load_config(overrides={"tiers": {"storage": [
        {"kind": "memory", "codec": [{"kind": "aes-gcm", "key": KEY_B}]}]}}, env={})
    assert KEY_B not in with_key.to_yaml() and KEY_B not in repr(with_key)


async def test_a_backend_of_fixed_size_pages_refuses_a_chain() -> None:
    from hicache.tiers.storage.memory import MemoryBackend

    class FixedOnly(MemoryBackend):
        variable_size_pages = False

    with pytest.raises(ConfigError, match="one size only"):
        StorageTier("t", FixedOnly(), codec("lossless"), await host_pool(), batch_pages=1)


async def test_the_cache_serves_a_lossy_tier_end_to_end(tmp_path: os.PathLike) -> None:
    from hicache import HiCache

    from .conftest import make_config, make_kv, make_tokens
    from .helpers import push_to_storage

    config = make_config(4, 16, tiers={"storage": [
        {"kind": "file", "path": str(tmp_path), "fsync": "never", "codec": ["int8", "lossless"]}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4})
    tokens, kv = make_tokens(config.page_size * 3), make_kv(config, config.page_size * 3)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await push_to_storage(cache)
        written = cache.stats().storage["file"]
        assert written.codec.encoded_pages == 3 and written.codec.saved_bytes > 0
        from hicache.metrics import HiCacheCollector

        samples = {(m.name, tuple(sorted(x.labels.items()))): x.value
                   for m in HiCacheCollector(cache).collect() for x in m.samples}
        logical = samples[("hicache_storage_codec_bytes", (("direction", "encode"), ("form", "logical"),
                                                             ("kind", "file"), ("tier", "file")))]
        stored = samples[("hicache_storage_codec_bytes", (("direction", "encode"), ("form", "stored"),
                                                            ("kind", "file"), ("tier", "file")))]
        assert logical == 3 * config.page_bytes and 0 < stored < logical / 1.9
    async with HiCache.from_config(config) as cache:  # a fresh process: only the file tier holds the pages
        hit = await cache.lookup(tokens)
        assert hit.tokens == len(tokens)
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert view.tokens == len(tokens)
            for layer in range(kv.shape[1]):
                k, v = view.layer(layer)
                assert torch.allclose(k, kv[0, layer], atol=0.05) and torch.allclose(v, kv[1, layer], atol=0.05)
                assert not torch.equal(k, kv[0, layer])  # quantised, as asked
        assert cache.stats().storage["file"].codec.decoded_pages == 3


def test_inspect_shows_each_pages_codec_and_bytes_saved(tmp_path, capsys) -> None:  # noqa: ANN001
    import json

    import anyio
    import yaml

    from hicache import HiCache
    from hicache.inspect.cli import main

    from .conftest import make_config, make_kv, make_tokens
    from .helpers import push_to_storage

    entry = {"kind": "file", "path": str(tmp_path / "pages"), "codec": ["lossless"]}
    config = make_config(4, 16, tiers={"storage": [entry]})

    async def fill() -> None:
        async with HiCache.from_config(config) as cache:
            await cache.store(make_tokens(config.page_size * 2), make_kv(config, config.page_size * 2))
            await push_to_storage(cache)

    anyio.run(fill)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert main(["pages", str(path), "--json", "--quiet"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [p["codec"] for p in listing["pages"]] == ["lossless", "lossless"]
    assert all(p["ours"] and p["format"] == 3 and p["saved_bytes"] > 0 for p in listing["pages"])
    assert main(["summary", str(path), "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "lossless" in table and "this config" in table
    assert main(["verify", str(path), "--quiet"]) == 0
    assert "2 verified" in capsys.readouterr().out
