"""Pages received into and sent from their own buffers (``redis_pages.py``), against a real
valkey-server: what does not fit is read past and the connection stays in step, error replies and
both protocols' nulls are misses, and a server that stops answering costs ``timeout_s``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import redis

from hicache.errors import StorageTimeoutError
from hicache.tiers.storage.base import PageIO
from hicache.tiers.storage.page_format import HEADER_BYTES
from hicache.tiers.storage.redis import RedisBackend
from hicache.tiers.storage.redis_pages import get_into, set_from

from .servers import ServerProcess, stalled, start_valkey

PAYLOAD = 3 << 20  # bigger than a socket buffer: a value arrives in pieces


@pytest.fixture
def valkey(tmp_path: Path):
    server = start_valkey(tmp_path)
    yield server
    server.stop()


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def page(i: int, pieces: int = 1) -> PageIO:
    rng = np.random.default_rng(i)
    payload = rng.integers(0, 256, PAYLOAD, dtype=np.uint8)
    return PageIO.of(rng.integers(0, 256, HEADER_BYTES, dtype=np.uint8), *np.array_split(payload, pieces))


def empty(n: int, pieces: int = 1) -> list[PageIO]:
    return [PageIO.of(np.zeros(HEADER_BYTES, np.uint8), *np.array_split(np.zeros(PAYLOAD, np.uint8), pieces))
            for _ in range(n)]


def same(a: PageIO, b: PageIO) -> bool:
    return b"".join(a.buffers()) == b"".join(b.buffers())


def backend(server: ServerProcess, timeout_s: float = 2.0) -> RedisBackend:
    # One connection: every call after a bad reply reuses the one that carried it.
    return RedisBackend(url=f"redis://127.0.0.1:{server.port}/0", key_prefix="pages", max_connections=1,
                        timeout_s=timeout_s)


async def test_what_does_not_fit_or_errs_is_a_miss_and_the_connection_stays_in_step(valkey: ServerProcess) -> None:
    async with backend(valkey) as b:
        pages = [page(i, pieces=3) for i in range(4)]
        assert await b.set([key(i) for i in range(4)], pages) == 4
        raw = redis.Redis(port=valkey.port)
        raw.set(b._key(key(1)), b"x" * (PAYLOAD // 2))  # another process's value, of another size
        out = empty(4, pieces=3)
        assert await b.get([key(i) for i in range(4)], out) == 1  # page 1 is a miss: the count ends there
        assert same(out[0], pages[0])
        out = empty(2)
        assert await b.get([key(2), key(3)], out) == 2  # the same connection, in step after the value read past
        assert same(out[0], pages[2]) and same(out[1], pages[3])
        raw.delete(b._key(key(2)))
        raw.rpush(b._key(key(2)), b"not a string")  # GET answers WRONGTYPE
        assert await b.get([key(3), key(2), key(0)], empty(3)) == 1
        assert await b.get([key(0)], out[:1]) == 1 and same(out[0], pages[0])
        assert b.stats().errors == 1  # the error reply, counted
        raw.close()


def test_both_protocols_nulls_are_misses(valkey: ServerProcess) -> None:
    for protocol in (2, 3):
        with redis.Redis(port=valkey.port, protocol=protocol) as client:
            names = [b"pages-null:a", b"pages-null:b"]
            assert set_from(client, names[:1], [page(0)], ttl_s=60, timeout_s=2.0) == [True]
            assert 0 < client.ttl(names[0]) <= 60
            out = empty(2)
            assert get_into(client, names, out, variable=False, timeout_s=2.0) == [HEADER_BYTES + PAYLOAD, None]
            assert same(out[0], page(0))
            client.delete(*names)


async def test_a_stalled_server_costs_timeout_s_and_is_used_again(valkey: ServerProcess) -> None:
    async with backend(valkey, timeout_s=1.0) as b:
        assert await b.set([key(0)], [page(0)]) == 1
        assert valkey.proc is not None
        with stalled(valkey.proc.pid):
            started = time.monotonic()
            with pytest.raises(StorageTimeoutError):
                await b.get([key(0)], empty(1))
            with pytest.raises(StorageTimeoutError):
                await b.set([key(i) for i in range(1, 9)], [page(i) for i in range(1, 9)])  # more than buffers hold
            assert time.monotonic() - started < 4
        out = empty(1)
        assert await b.get([key(0)], out) == 1 and same(out[0], page(0))
        assert await b.set([key(1)], [page(1)]) == 1
