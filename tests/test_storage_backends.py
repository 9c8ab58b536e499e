"""The backend contract: one suite, run against every storage backend.

A new backend joins by adding a fixture case to ``backend_factory`` (server-backed ones may skip
when their server cannot start). The suite talks to backends through the public verbs only, with
raw ``PageIO`` buffers, so it checks the backend, not the cache around it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from hicache.errors import CacheClosedError, InvalidRequestError
from hicache.tiers.storage import HEADER_BYTES, PageIO, StorageBackend
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.memory import MemoryBackend
from hicache.tiers.storage.mooncake import MooncakeBackend
from hicache.tiers.storage.nixl.agent import nixl_available
from hicache.tiers.storage.nixl.posix import NixlFileBackend
from hicache.tiers.storage.redis import RedisBackend
from hicache.tiers.storage.s3 import S3Backend

from .nixl_peers import PeerPair
from .servers import unavailable

PAYLOAD = 4096
PAGE = HEADER_BYTES + PAYLOAD

BackendFactory = Callable[..., StorageBackend]


@pytest.fixture(params=["memory", "file", "file-direct", "redis", "mooncake", "s3", "redis-cluster", "nixl", "nixl-peer"])
def backend_factory(request: pytest.FixtureRequest, tmp_path: Path) -> BackendFactory:
    """``factory(**settings)`` builds a fresh backend of this kind (file, file-direct: O_DIRECT, nixl: in a per-test folder;
    redis, s3: under a per-test key prefix on the session's server or cluster; nixl-peer: a producer
    and a consumer agent in this process, reads going through UCX)."""
    if request.param == "memory":
        return lambda **kw: MemoryBackend(**kw)
    if request.param in ("nixl", "nixl-peer"):
        why = nixl_available()
        if why is not None:
            unavailable(why)
        if request.param == "nixl":
            return lambda **kw: NixlFileBackend(path=str(tmp_path / "pages"), **kw)
        return lambda **kw: PeerPair(**kw)
    if request.param == "redis":
        server = request.getfixturevalue("valkey")
        prefix = f"t{uuid.uuid4().hex[:12]}"
        url = f"redis://127.0.0.1:{server.port}/0"
        return lambda **kw: RedisBackend(url=url, key_prefix=prefix, **kw)
    if request.param == "redis-cluster":
        cluster = request.getfixturevalue("valkey_cluster")
        prefix = f"t{uuid.uuid4().hex[:12]}"
        return lambda **kw: RedisBackend(url=cluster.url, cluster=True, key_prefix=prefix, **kw)
    if request.param == "s3":
        s3 = request.getfixturevalue("seaweedfs")
        prefix = f"t{uuid.uuid4().hex[:12]}"
        return lambda **kw: S3Backend(**s3.settings(key_prefix=prefix, **kw))
    if request.param == "mooncake":
        settings = request.getfixturevalue("mooncake_cluster")
        prefix = f"t{uuid.uuid4().hex[:12]}"
        return lambda **kw: MooncakeBackend(**(settings | {"key_prefix": prefix} | kw))
    if request.param == "file-direct":
        return lambda **kw: FileBackend(path=str(tmp_path / "pages"), direct_io=True, **kw)
    return lambda **kw: FileBackend(path=str(tmp_path / "pages"), **kw)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def page(i: int, salt: int = 0, cuts: tuple[int, ...] = ()) -> PageIO:
    """Page ``i``'s bytes; ``cuts`` splits the payload into pieces at those offsets."""
    rng = np.random.default_rng(i * 7919 + salt)
    header = rng.integers(0, 256, HEADER_BYTES, dtype=np.uint8)
    payload = rng.integers(0, 256, PAYLOAD, dtype=np.uint8)
    return PageIO.of(header, *np.split(payload, list(cuts)))


def empty(n: int, cuts: tuple[int, ...] = ()) -> list[PageIO]:
    pieces = list(cuts)
    return [PageIO.of(np.zeros(HEADER_BYTES, np.uint8), *np.split(np.zeros(PAYLOAD, np.uint8), pieces)) for _ in range(n)]


def same(a: PageIO, b: PageIO) -> bool:
    return b"".join(a.buffers()) == b"".join(b.buffers())


@asynccontextmanager
async def opened(factory: BackendFactory, **settings: object) -> AsyncIterator[StorageBackend]:
    async with factory(**settings) as backend:
        yield backend


async def test_set_then_get_is_bit_exact(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory) as b:
        keys = [key(i) for i in range(5)]
        assert await b.set(keys, [page(i) for i in range(5)]) == 5
        out = empty(5)
        assert await b.get(keys, out) == 5
        assert all(same(out[i], page(i)) for i in range(5))


async def test_payload_pieces_scatter_and_gather(backend_factory: BackendFactory) -> None:
    """A payload in pieces (a layer-first host page) is stored whole and read into other pieces."""
    async with opened(backend_factory) as b:
        assert await b.set([key(0)], [page(0, cuts=(1000, 1024, 3000))]) == 1
        out = empty(1, cuts=(4000,))
        assert await b.get([key(0)], out) == 1
        assert same(out[0], page(0)) and len(out[0].payload) == 2


async def test_exists_counts_consecutive_keys_from_the_start(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory) as b:
        await b.set([key(0), key(1), key(3)], [page(0), page(1), page(3)])
        assert await b.exists([key(0), key(1), key(2), key(3)]) == 2
        assert await b.exists([key(2), key(3)]) == 0
        assert await b.exists([key(3)]) == 1
        assert await b.exists([]) == 0


async def test_a_header_only_object_is_stored_seen_and_deleted(backend_factory: BackendFactory) -> None:
    """What a hand-off's gave-up marker is (``StorageTier.mark``): a header and no payload, whose
    presence alone is the message."""
    async with opened(backend_factory) as b:
        marker = PageIO.of(bytes(range(HEADER_BYTES)))
        assert await b.set([key(7)], [marker]) == 1
        assert await b.exists([key(7)]) == 1
        await b.delete([key(7)])
        assert await b.exists([key(7)]) == 0


async def test_get_stops_at_the_first_missing_page(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory) as b:
        await b.set([key(0), key(2)], [page(0), page(2)])
        out = empty(3)
        assert await b.get([key(0), key(1), key(2)], out) == 1
        assert same(out[0], page(0))


async def test_overwrite_keeps_the_latest_page(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory) as b:
        await b.set([key(0)], [page(0)])
        await b.set([key(0)], [page(0, salt=1)])
        out = empty(1)
        assert await b.get([key(0)], out) == 1
        assert same(out[0], page(0, salt=1))
        assert b.stats().stored_pages == 1


async def test_delete_and_clear(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory) as b:
        keys = [key(i) for i in range(4)]
        await b.set(keys, [page(i) for i in range(4)])
        await b.delete([key(1), key(99)])  # a missing key is ignored
        assert await b.exists(keys) == 1
        assert await b.exists(keys[2:]) == 2
        await b.clear()
        assert await b.exists(keys) == 0
        assert b.stats().stored_pages == 0 and b.stats().used_bytes == 0


async def test_capacity_evicts_least_recently_used(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory, capacity=3 * PAGE) as b:
        await b.set([key(0), key(1), key(2)], [page(0), page(1), page(2)])
        assert await b.get([key(0)], empty(1)) == 1  # page 0 is now the most recently used
        await b.set([key(3), key(4)], [page(3), page(4)])
        assert [await b.exists([key(i)]) for i in range(5)] == [1, 0, 0, 1, 1]
        stats = b.stats()
        assert stats.evicted_pages == 2
        assert stats.used_bytes is not None and stats.used_bytes <= 3 * PAGE


async def test_capacity_is_never_exceeded_by_one_write(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory, capacity=2 * PAGE + 10) as b:
        assert await b.set([key(i) for i in range(4)], [page(i) for i in range(4)]) == 2
        assert await b.exists([key(0), key(1), key(2)]) == 2
        assert b.stats().used_bytes == 2 * PAGE


async def test_batches_larger_than_max_batch(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory) as b:
        n = b.max_batch + 7
        keys = [key(i) for i in range(n)]
        assert await b.set(keys, [page(i) for i in range(n)]) == n
        assert await b.exists(keys) == n
        out = empty(n)
        assert await b.get(keys, out) == n
        assert same(out[-1], page(n - 1))


async def test_stats_count_traffic(backend_factory: BackendFactory) -> None:
    async with opened(backend_factory) as b:
        await b.set([key(0), key(1)], [page(0), page(1)])
        await b.get([key(0), key(1)], empty(2))
        await b.exists([key(0)])
        s = b.stats()
        assert (s.pages_written, s.pages_read) == (2, 2)
        assert s.bytes_written == s.bytes_read == 2 * PAGE
        assert s.calls["set"] == s.calls["get"] == s.calls["exists"] == 1
        assert (s.errors, s.timeouts, s.corrupt_pages) == (0, 0, 0)
        assert s.stored_pages == 2


async def test_bad_arguments_raise_typed_errors(backend_factory: BackendFactory) -> None:
    backend = backend_factory()
    with pytest.raises(CacheClosedError):
        await backend.exists([key(0)])
    async with backend as b:
        with pytest.raises(InvalidRequestError, match="16 bytes"):
            await b.exists([b"short"])
        with pytest.raises(InvalidRequestError, match="single key"):
            await b.exists(key(0))  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="2 keys but 1"):
            await b.set([key(0), key(1)], [page(0)])
        with pytest.raises(InvalidRequestError, match="header"):
            await b.set([key(0)], [PageIO.of(b"x", *page(0).payload)])
        assert await b.exists([key(0)]) == 0  # nothing was written by the rejected calls


async def test_a_page_reported_landed_is_whole_in_its_buffers(backend_factory: BackendFactory) -> None:
    """``PageIO.landed``: called at most once per page, only for pages read (whole, at that moment),
    from any thread; ``kind: file`` and ``kind: nixl-peer`` report every page they read."""
    async with opened(backend_factory) as b:
        keys = [key(i) for i in range(6)]
        assert await b.set(keys[:4], [page(i) for i in range(4)]) == 4
        seen: list[tuple[int, bool]] = []
        out: list[PageIO] = []
        for i, io in enumerate(empty(6, cuts=(1500,))):
            # the bytes as they are when the hook runs: the page must be complete by then
            out.append(io._replace(landed=lambda i=i: seen.append((i, same(out[i], page(i))))))
        assert await b.get(keys, out) == 4
        assert all(same(out[i], page(i)) for i in range(4))
        assert all(whole for _, whole in seen) and len({i for i, _ in seen}) == len(seen)
        assert {i for i, _ in seen} <= set(range(4))
        if type(b) in (FileBackend, PeerPair):
            assert sorted(i for i, _ in seen) == [0, 1, 2, 3]


async def test_pages_are_sealed_by_backends_that_seal_and_refused_by_the_others(backend_factory: BackendFactory) -> None:
    """``PageIO.seal`` fills the header in the writer's thread, before the page is written; a backend
    without ``seals_pages`` refuses sealed pages (it would store blank headers)."""
    async with opened(backend_factory) as b:
        sealed = []
        for i in range(3):
            want = page(i)
            blank = PageIO.of(np.zeros(HEADER_BYTES, np.uint8), *want.payload)
            sealed.append(blank._replace(seal=lambda blank=blank, want=want: blank.header.__setitem__(slice(None), want.header)))
        keys = [key(i) for i in range(3)]
        if not type(b).seals_pages:
            with pytest.raises(InvalidRequestError, match="does not seal"):
                await b.set(keys, sealed)
            assert await b.exists(keys) == 0
            return
        assert await b.set(keys, sealed) == 3
        out = empty(3)
        assert await b.get(keys, out) == 3
        assert all(same(out[i], page(i)) for i in range(3))  # the sealed headers, as written


# -- file backend specifics ----------------------------------------------------------------------


async def test_file_pages_survive_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    async with FileBackend(path=str(root)) as b:
        await b.set([key(i) for i in range(3)], [page(i) for i in range(3)])
    async with FileBackend(path=str(root)) as b:
        assert b.stats().stored_pages == 3
        out = empty(3)
        assert await b.get([key(i) for i in range(3)], out) == 3
        assert all(same(out[i], page(i)) for i in range(3))


async def test_file_names_come_from_keys_only(tmp_path: Path) -> None:
    async with FileBackend(path=str(tmp_path)) as b:
        await b.set([key(1)], [page(1)])
        files = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
        assert files == [f"{key(1).hex()[:2]}/{key(1).hex()}.kv"]


async def test_file_finds_pages_another_process_wrote_after_it_opened(tmp_path: Path) -> None:
    async with FileBackend(path=str(tmp_path)) as reader, FileBackend(path=str(tmp_path)) as writer:
        await writer.set([key(0), key(1)], [page(0), page(1)])
        assert await reader.exists([key(0), key(1)]) == 2
        out = empty(2)
        assert await reader.get([key(0), key(1)], out) == 2 and same(out[1], page(1))


async def test_file_truncated_page_is_a_miss_and_removed(tmp_path: Path) -> None:
    async with FileBackend(path=str(tmp_path)) as b:
        await b.set([key(0)], [page(0)])
        path = b.path_of(key(0))
        os.truncate(path, PAGE - 100)
        assert await b.get([key(0)], empty(1)) == 0
        assert not path.exists()
        assert b.stats().corrupt_pages == 1
        assert await b.exists([key(0)]) == 0


async def test_file_stale_temporary_files_are_removed_at_open(tmp_path: Path) -> None:
    shard = tmp_path / "ab"
    shard.mkdir()
    stale, fresh = shard / ".x.1.dead.tmp", shard / ".y.2.live.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (0, 0))
    async with FileBackend(path=str(tmp_path)) as b:
        assert b.stats().stored_pages == 0
    assert not stale.exists() and fresh.exists()


async def test_file_fsync_never_still_writes_atomically(tmp_path: Path) -> None:
    async with FileBackend(path=str(tmp_path), fsync="never") as b:
        await b.set([key(0)], [page(0)])
        out = empty(1)
        assert await b.get([key(0)], out) == 1 and same(out[0], page(0))
        assert not list(tmp_path.rglob("*.tmp"))


async def test_file_fsync_always_syncs_every_page_and_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hicache.tiers.storage.page_files as page_files

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(page_files.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    async with FileBackend(path=str(tmp_path)) as b:  # the default: no fsync
        assert b.settings.fsync == "never"
        await b.set([key(0)], [page(0)])
        assert synced == []
    async with FileBackend(path=str(tmp_path), fsync="always") as b:
        await b.set([key(1), key(2)], [page(1), page(2)])
        out = empty(2)
        assert await b.get([key(1), key(2)], out) == 2 and same(out[0], page(1)) and same(out[1], page(2))
    assert len(synced) >= 4  # each page file, and the shard folder it was renamed into


async def test_file_writes_without_a_temporary_name_and_falls_back_to_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New pages are linked into place from an unnamed file (O_TMPFILE); a rewrite, or a file
    system without O_TMPFILE, goes through a temporary name and a rename: whole pages either way."""
    import hicache.tiers.storage.page_files as page_files

    async with FileBackend(path=str(tmp_path)) as b:
        assert page_files._anonymous[0]  # this file system takes O_TMPFILE
        await b.set([key(0)], [page(0)])
        await b.set([key(0)], [page(0, salt=1)])  # the name is taken: tmp + rename
        monkeypatch.setattr(page_files, "_anonymous", [False])
        await b.set([key(1)], [page(1)])
        out = empty(2)
        assert await b.get([key(0), key(1)], out) == 2 and same(out[0], page(0, salt=1)) and same(out[1], page(1))
        assert not list(tmp_path.rglob("*.tmp"))
