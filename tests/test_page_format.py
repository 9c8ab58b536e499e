"""The canonical page format: headers name what a page is, and any mismatch is a miss.

The codec is checked field by field; then real page files are damaged on disk (truncated, bit
flipped, replaced by a foreign namespace's or another geometry's page) and a fresh cache must treat
each as a miss, count it and remove it, never hand the bytes to the engine.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache import HiCache
from hicache.keys import as_token_bytes, chain_keys
from hicache.tiers.base import KVGeometry
from hicache.tiers.storage.page_format import _CHECKSUM_AT, HEADER_BYTES, PageCodec

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent

GEOMETRY = KVGeometry(components=2, num_layers=3, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
NS = bytes(range(16))
KEY = bytes(range(16, 32))


def encoded(codec: PageCodec) -> tuple[memoryview, memoryview]:
    payload = memoryview(np.random.default_rng(1).integers(0, 256, codec.payload_bytes, dtype=np.uint8))
    header = memoryview(np.zeros(HEADER_BYTES, dtype=np.uint8))
    codec.encode(KEY, [payload], header)
    return header, payload


def test_codec_round_trip() -> None:
    codec = PageCodec(NS, GEOMETRY)
    header, payload = encoded(codec)
    assert bytes(header[:8]) == b"HICACHE\x00"
    assert codec.check(KEY, header, [payload]) is None


@pytest.mark.parametrize(
    ("reader", "key", "reason"),
    [
        (PageCodec(bytes(16), GEOMETRY), KEY, "namespace"),
        (PageCodec(NS, KVGeometry(2, 3, 4, 2, 16, torch.float16)), KEY, "geometry"),  # another head_dim
        (PageCodec(NS, KVGeometry(2, 3, 4, 4, 4, torch.float16)), KEY, "geometry"),  # same bytes, other shape
        (PageCodec(NS, KVGeometry(2, 3, 4, 2, 8, torch.bfloat16)), KEY, "geometry"),  # same bytes, other dtype
        (PageCodec(NS, GEOMETRY), bytes(16), "key"),
    ],
)
def test_foreign_pages_are_rejected(reader: PageCodec, key: bytes, reason: str) -> None:
    header, payload = encoded(PageCodec(NS, GEOMETRY))
    if len(payload) != reader.payload_bytes:
        assert reader.check(key, header, [payload]) == "truncated"
        payload = memoryview(np.zeros(reader.payload_bytes, np.uint8))  # as if the sizes matched
    assert reader.check(key, header, [payload]) == reason


@pytest.mark.parametrize(
    ("offset", "reason"), [(0, "magic"), (8, "version"), (HEADER_BYTES - 1, "padding"), (-1, "checksum")]
)
def test_damaged_bytes_are_rejected(offset: int, reason: str | None) -> None:
    codec = PageCodec(NS, GEOMETRY)
    header, payload = encoded(codec)
    target = payload if offset < 0 else header
    target[offset] ^= 0xFF
    # The last header byte is padding: outside every field and the checksum, and checked to be zero.
    assert codec.check(KEY, header, [payload]) == reason


def test_check_catches_a_checksum_field_flip() -> None:
    codec = PageCodec(NS, GEOMETRY)
    header, payload = encoded(codec)
    header[_CHECKSUM_AT + 3] ^= 1  # inside the checksum field
    assert codec.check(KEY, header, [payload]) == "checksum"


# -- damaged files through a real cache ----------------------------------------------------------


def file_config(root: Path, **overrides: object):
    return make_config(
        8, 16,
        tiers={"storage": [{"kind": "file", "path": str(root)}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
        **overrides,
    )


async def write_pages(config, tokens: list[int], seed: int = 0) -> None:
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, make_kv(config, len(tokens), seed))
        await cache.wait_idle()


def page_files(config, tokens: list[int], root: Path) -> list[Path]:
    cache = HiCache.from_config(config)
    keys = chain_keys(cache.namespace.digest, as_token_bytes(tokens), config.page_size)
    return [root / k.hex()[:2] / (k.hex() + ".kv") for k in keys]


def corrupt_truncate(path: Path, _: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def corrupt_flip(path: Path, _: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def corrupt_foreign(path: Path, foreign: Path) -> None:
    os.replace(foreign, path)


@pytest.mark.parametrize(
    ("damage", "foreign_overrides"),
    [
        (corrupt_truncate, None),
        (corrupt_flip, None),
        (corrupt_foreign, {"tenant_salt": "another-tenant"}),  # same shape, foreign namespace
        (corrupt_foreign, {"model": {"num_kv_heads": 1, "head_dim": 16}}),  # same size, other geometry
    ],
    ids=["truncated", "bit-flip", "foreign-namespace", "wrong-geometry"],
)
async def test_damaged_page_file_is_a_miss(tmp_path: Path, damage, foreign_overrides) -> None:
    root = tmp_path / "pages"
    config = file_config(root)
    tokens = make_tokens(6 * config.page_size)
    await write_pages(config, tokens)
    files = page_files(config, tokens, root)
    assert all(f.exists() for f in files)
    foreign = tmp_path / "foreign.kv"
    if foreign_overrides is not None:
        other = file_config(tmp_path / "other", **foreign_overrides)
        assert other.page_bytes == config.page_bytes
        await write_pages(other, tokens, seed=9)
        os.replace(page_files(other, tokens, tmp_path / "other")[3], foreign)
    damage(files[3], foreign)  # the fourth page of six

    async with HiCache.from_config(config) as cache:
        kv = make_kv(config, len(tokens))
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert view.tokens == 3 * config.page_size  # the pages before the damaged one
            k, v = view.layer(1)
            assert torch.equal(k, kv[0, 1, : view.tokens]) and torch.equal(v, kv[1, 1, : view.tokens])
        await cache.wait_idle()
        backend = cache.stats().storage["file"].backend
        assert backend.corrupt_pages == 1
        assert not files[3].exists()  # removed, so it is not read again
        assert_consistent(cache)


# -- every header byte counts (issue 50, item 16) --------------------------------------------------
#
# The bytes after a header's check value were neither checked nor authenticated: with aes-gcm a
# flipped byte at offset 100, 116 or 127, and with a tenant key at 116 or 127, read as a good page.
# Each of the 128 header bytes is flipped in turn, in every mode, through a real tier over the
# reference backend: each flip must be a counted miss (corrupt_pages), never a page served.

HEADER_MODES = {
    "no key": ((), None),
    "tenant key": ((), "a-tenant-key-for-header-flips-0123"),
    "aes-gcm, its own key": (({"kind": "aes-gcm", "key": "a-stage-key-for-header-flips-456"},), None),
    "aes-gcm, from the tenant key": (("aes-gcm",), "a-tenant-key-for-header-flips-0123"),
    "lossless": (("lossless",), None),
    "lossless, tenant key": (("lossless",), "a-tenant-key-for-header-flips-0123"),
}


@pytest.mark.parametrize("mode", list(HEADER_MODES))
async def test_every_flipped_header_byte_is_a_counted_miss(mode: str) -> None:
    from hicache.tiers.storage.memory import MemoryBackend
    from hicache.tiers.storage.page_format import check_stored_page
    from hicache.tiers.storage.tier import StorageTier

    from .test_codecs import codec, host_pool, put_blob, stored_blob

    stages, tenant = HEADER_MODES[mode]
    c = codec(*stages, tenant=tenant)
    host = await host_pool()
    saved = host.buffer.clone()
    key = bytes([7]) * 16
    name = c.storage_keys([key])[0]
    served = []
    async with StorageTier("t", MemoryBackend(), c, host, batch_pages=1) as tier:
        assert await tier.store([key], [0]) == 1
        good = await stored_blob(tier.backend, name, HEADER_BYTES + c.max_stored_bytes)
        assert check_stored_page(c, name, bytes(good)).status == "ok"
        for offset in range(HEADER_BYTES):
            for bit in (0x01, 0x80):
                bad = bytearray(good)
                bad[offset] ^= bit
                await put_blob(tier.backend, name, bad)
                before = tier.backend.corrupt_pages
                host.buffer.zero_()
                if await tier.fetch([key], [0]) != 0 or tier.backend.corrupt_pages != before + 1:
                    served.append((offset, bit))
                # inspect verify: never "ok" (a flipped namespace or version field makes a keyed page
                # look like another tenant's: unverifiable, neither good nor removed)
                assert check_stored_page(c, name, bytes(bad)).status != "ok", (offset, bit)
        await put_blob(tier.backend, name, good)  # and the intact page still reads
        host.buffer.zero_()
        assert await tier.fetch([key], [0]) == 1
        assert torch.equal(host.buffer[0].view(torch.uint8), saved[0].view(torch.uint8))
    assert not served, f"header flips read as good pages or not counted (offset, bit): {served}"

