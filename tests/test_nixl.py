"""The NIXL backends beyond the contract suites: ``kind: nixl`` (POSIX plugin) and ``kind: nixl-peer``
(UCX), with real agents; a prefill-like process and a decode-like process on loopback.

The contract (``test_storage_backends``) and the codec chains (``test_codecs``) run on both kinds
already; here: the folder shared with ``kind: file``, the plugin's I/O engines, the arena's leases,
a producer process serving another process's cache, a producer gone, and producers that stall or
answer nonsense (fault-injecting fakes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import ConfigError, StorageBackendError, StorageError
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.nixl.agent import nixl_available
from hicache.tiers.storage.nixl.peer_arena import PageArena, _Extents

from .fakes import FakeProducer
from .servers import free_port, unavailable
from .test_storage_backends import PAGE, empty, key, page, same

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def nixl() -> None:
    why = nixl_available()
    if why is not None:
        unavailable(why)


# -- the arena (no NIXL needed) ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=60))
def test_free_ranges_never_overlap_and_merge_back(ops: list[tuple[bool, int]]) -> None:
    size = 1000
    extents = _Extents(size)
    held: list[list[tuple[int, int]]] = []
    for take, n in ops:
        if take or not held:
            spans = extents.take(n)
            if spans is None:
                assert extents.free < n
                continue
            assert sum(length for _, length in spans) == n
            held.append(spans)
        else:
            extents.give(held.pop(n % len(held)))
        taken = sorted(s for spans in held for s in spans)
        pieces = sorted(taken + extents.ranges())
        assert all(a[0] + a[1] <= b[0] for a, b in zip(pieces, pieces[1:], strict=False))  # no overlap
        assert sum(n for _, n in pieces) == size and extents.free == sum(n for _, n in extents.ranges())
        ranges = extents.ranges()
        assert all(a[0] + a[1] < b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # merged
    for spans in held:
        extents.give(spans)
    assert extents.ranges() == [(0, size)]


def test_a_leased_page_keeps_its_bytes_until_the_lease_ends() -> None:
    arena = PageArena(2 * PAGE, lease_s=30)
    assert arena.store([key(0)], [page(0)]) == 1
    lease, found = arena.locate([key(0)], lease=True)
    assert lease and len(found) == 1
    # Overwritten and deleted while a reader holds it: gone from the index, its bytes untouched.
    assert arena.store([key(0)], [page(0, salt=1)]) == 1
    arena.delete([key(0)])
    assert arena.count([key(0)]) == 0
    (start, n), = found[0].spans
    assert bytes(arena.buffer[start : start + n]) == b"".join(page(0).buffers())
    # A leased page is never evicted; two new pages need its room, so only one fits.
    assert arena.store([key(1), key(2)], [page(1), page(2)]) == 1
    arena.release(lease)
    assert arena.store([key(2)], [page(2)]) == 1 and arena.leases() == 0


def test_a_page_is_never_scattered_over_more_than_max_spans_ranges() -> None:
    """65 one-byte holes hold a 65-byte page only in 65 pieces: one more page is evicted first."""
    from hicache.tiers.storage.base import PageIO
    from hicache.tiers.storage.nixl.peer_arena import MAX_SPANS

    assert MAX_SPANS == 64
    arena = PageArena(129, lease_s=30)
    assert arena.store([key(i) for i in range(129)], [PageIO.of(b"a") for _ in range(129)]) == 129
    arena.delete([key(i) for i in range(0, 129, 2)])  # 65 holes of one byte
    assert arena.store([key(500)], [PageIO.of(b"b" * 65)]) == 1
    assert arena.evicted == 1 and arena.count([key(1)]) == 0  # the least recently used page went
    assert len(arena.locate([key(500)], lease=False)[1][0].spans) <= MAX_SPANS


def test_an_expired_lease_frees_its_pages() -> None:
    arena = PageArena(PAGE, lease_s=0.05)
    arena.store([key(0)], [page(0)])
    arena.locate([key(0)], lease=True)
    arena.delete([key(0)])
    time.sleep(0.1)
    assert arena.store([key(1)], [page(1)]) == 1 and arena.leases() == 0


# -- kind: nixl (the POSIX plugin) -------------------------------------------------------------------


async def test_nixl_and_file_tiers_read_each_others_folders(nixl: None, tmp_path: Path) -> None:
    from hicache.tiers.storage.nixl.posix import NixlFileBackend

    async with NixlFileBackend(path=str(tmp_path)) as n, FileBackend(path=str(tmp_path)) as f:
        assert await n.set([key(0), key(1)], [page(0), page(1, cuts=(100, 2000))]) == 2
        await f.set([key(2)], [page(2)])
        out = empty(3, cuts=(3000,))
        assert await f.get([key(0), key(1)], out[:2]) == 2
        assert await n.get([key(2)], out[2:]) == 1
        assert all(same(out[i], page(i)) for i in range(3))
        assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("io", ["aio", "uring", "posix_aio"])
async def test_nixl_io_engines(nixl: None, tmp_path: Path, io: str) -> None:
    from hicache.tiers.storage.nixl.posix import NixlFileBackend

    async with NixlFileBackend(path=str(tmp_path), io=io, fsync="always") as b:
        assert await b.set([key(i) for i in range(3)], [page(i) for i in range(3)]) == 3
        out = empty(3)
        assert await b.get([key(i) for i in range(3)], out) == 3 and all(same(out[i], page(i)) for i in range(3))


async def test_nixl_a_truncated_page_is_a_miss_and_removed(nixl: None, tmp_path: Path) -> None:
    from hicache.tiers.storage.nixl.posix import NixlFileBackend

    async with NixlFileBackend(path=str(tmp_path)) as b:
        await b.set([key(0), key(1)], [page(0), page(1)])
        os.truncate(b.path_of(key(1)), PAGE - 100)
        out = empty(2)
        assert await b.get([key(0), key(1)], out) == 1 and same(out[0], page(0))
        assert not b.path_of(key(1)).exists() and b.stats().corrupt_pages == 1


# -- kind: nixl-peer (UCX) ----------------------------------------------------------------------------


def test_nixl_peer_settings_name_a_role_and_addresses() -> None:
    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    with pytest.raises(ConfigError, match="listen"):
        NixlPeerBackend()
    with pytest.raises(ConfigError, match="host:port"):
        NixlPeerBackend(peers=["no-port"])
    with pytest.raises(ConfigError, match="host:port"):
        NixlPeerBackend(listen="127.0.0.1:99999")
    token = "a-token-of-16-characters-or-more"
    assert NixlPeerBackend(listen="[::1]:0", peers=["prefill-0.internal:7400"], peer_token=token).settings.peers


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")])}
    return subprocess.Popen([sys.executable, "-m", "tests.remote_worker", *args], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # two engine processes: ~9 s on 2 busy cores
async def test_a_decode_process_pulls_the_prefill_processes_kv_and_a_producer_gone_is_a_miss(nixl: None) -> None:
    """Two engine processes on loopback: the first (a prefill server) stores three prompts into its
    nixl-peer tier and stays up; the second (a decode server, its own process) finds all of them in
    the first's memory, bit for bit, computing nothing. Then the producer exits: a consumer's read
    is a counted failure within its bounds, and later ones are plain misses at once."""
    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    port = free_port()
    writer = _spawn("store", json.dumps({"kind": "nixl-peer", "listen": f"127.0.0.1:{port}"}), "0", "3", "--hold")
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line, writer.stderr.read() if writer.stderr else ""
        assert json.loads(line) == {"stored_pages": 18, "skipped_pages": 0, "failures": 0}
        reader = _spawn("check", json.dumps({"kind": "nixl-peer", "peers": [f"127.0.0.1:{port}"]}), "0", "3")
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"hits": [24, 24, 24], "exact": [True] * 3, "corrupt": 0,
                                                            "fetched": 18}
        async with NixlPeerBackend(peers=[f"127.0.0.1:{port}"], timeout_s=2, retry_s=60) as consumer:
            assert await consumer.exists([bytes(16)]) == 0  # connected: a key it does not have
            writer.communicate(input="", timeout=60)  # the producer exits
            started = time.monotonic()
            with pytest.raises(StorageBackendError):
                await consumer.get([key(0)], empty(1))
            assert await consumer.get([key(0)], empty(1)) == 0  # skipped while down: a plain miss
            assert time.monotonic() - started < 10
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


@pytest.mark.parametrize("mode", ["silent", "garbage"])
async def test_a_producer_that_stalls_or_answers_nonsense_is_a_bounded_miss(nixl: None, mode: str) -> None:
    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    fake = FakeProducer(mode)
    try:
        async with NixlPeerBackend(peers=[f"127.0.0.1:{fake.port}"], timeout_s=0.5, connect_timeout_s=0.5) as b:
            started = time.monotonic()
            with pytest.raises(StorageError):  # the call's timeout, or the peer's failure: counted either way
                await b.exists([key(0)])
            assert await b.get([key(0)], empty(1)) == 0  # down for retry_s: not asked again
            assert time.monotonic() - started < 5
    finally:
        fake.stop()


async def test_a_consumer_reads_its_own_arena_first_then_its_peers(nixl: None) -> None:
    """``kv_both``: a backend that serves and pulls finds a prefix partly in its own arena and the
    rest at its peer, in one get."""
    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    async with NixlPeerBackend(listen="127.0.0.1:0") as producer:
        assert producer.address is not None
        await producer.set([key(1), key(2)], [page(1), page(2)])
        host, port = producer.address
        async with NixlPeerBackend(listen="127.0.0.1:0", peers=[f"{host}:{port}"]) as both:
            await both.set([key(0)], [page(0)])
            out = empty(3)
            assert await both.exists([key(0), key(1), key(2), key(3)]) == 3
            assert await both.get([key(0), key(1), key(2)], out) == 3
            assert all(same(out[i], page(i)) for i in range(3))


async def test_a_consumer_only_tier_is_read_only_to_the_cache(nixl: None) -> None:
    """A decode server's tier (``peers`` only) is written nothing and promised nothing: pages that
    leave its full host pool are not counted lost and no write fails, while the prefill server's
    pages still come from it, bit for bit."""
    from hicache import HiCache

    from .conftest import make_config, make_kv, make_tokens
    from .test_redis_tier import read_back

    port = free_port()
    producer = make_config(8, 32, tiers={"storage": [{"kind": "nixl-peer", "listen": f"127.0.0.1:{port}"}]})
    consumer = make_config(8, 16, tiers={"storage": [{"kind": "nixl-peer", "peers": [f"127.0.0.1:{port}"]}]},
                           policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4})
    prompts = [(make_tokens(24, seed=i), make_kv(consumer, 24, seed=i)) for i in range(8)]
    async with HiCache.from_config(producer) as prefill:
        await prefill.store(*prompts[0])
        await prefill.wait_idle()
        async with HiCache.from_config(consumer) as decode:
            for tokens, kv in prompts[1:]:  # 42 pages through a host pool of 16
                await decode.store(tokens, kv)
            await decode.wait_idle()
            assert await read_back(decode, *prompts[0]) == (24, True)  # the prefill's pages, over UCX
            stats = decode.stats()
            s = stats.storage["nixl-peer"]
            assert s.stored_pages == 0 and s.failures == 0 and s.backend.calls["set"] == 0
            assert s.fetched_pages == 6
            assert stats.tiers["host"].lost_pages == 0 and stats.tiers["device"].lost_pages == 0


async def test_a_page_placed_in_scattered_free_ranges_is_read_whole_over_ucx(nixl: None) -> None:
    """Free space in holes between pages still holds a page larger than any hole: it is placed in
    several ranges, and the consumer's one READ gathers them into its buffers in order."""
    from hicache.tiers.storage.base import PageIO
    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    async with NixlPeerBackend(listen="127.0.0.1:0", capacity=4 * PAGE) as producer:
        assert producer.address is not None and producer._arena is not None
        await producer.set([key(i) for i in range(4)], [page(i) for i in range(4)])
        await producer.delete([key(0), key(2)])  # two holes of one page each, apart
        big = np.random.default_rng(3).integers(0, 256, 2 * PAGE, dtype=np.uint8)
        assert await producer.set([key(9)], [PageIO.of(big[:128], big[128:])]) == 1
        assert len(producer._arena.locate([key(9)], lease=False)[1][0].spans) == 2
        host, port = producer.address
        async with NixlPeerBackend(peers=[f"{host}:{port}"]) as consumer:
            room = np.zeros(3 * PAGE, dtype=np.uint8)
            sizes = [0]
            assert await consumer.get([key(9)], [PageIO.of(room[:128], room[128:])], sizes=sizes) == 1
            assert sizes == [2 * PAGE] and np.array_equal(room[: 2 * PAGE], big)


async def test_open_peers_do_not_spin_a_core(nixl: None) -> None:
    """NIXL's progress thread spins unless it is given a delay: an open producer and consumer cost
    (nearly) no CPU while idle."""
    import anyio

    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    async with NixlPeerBackend(listen="127.0.0.1:0") as producer:
        assert producer.address is not None
        host, port = producer.address
        async with NixlPeerBackend(peers=[f"{host}:{port}"]) as consumer:
            assert await consumer.exists([key(0)]) == 0  # connected: both agents are live
            start = time.process_time()
            await anyio.sleep(1.0)
            assert time.process_time() - start < 0.25


def _resident(address: int, nbytes: int) -> float:
    """The share of ``nbytes`` at ``address`` (page-aligned) that is in memory (``mincore``)."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    pages = nbytes // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
    return sum(v & 1 for v in vec) / pages


@pytest.mark.parametrize("prefault", [True, False])
async def test_nixl_peer_prefault_faults_the_arena_in_at_open(nixl: None, prefault: bool) -> None:
    """With ``prefault`` the producer's arena is in memory soon after open, before any page is
    written (its first writes fault nothing); without it, it stays unfaulted (the control)."""
    import mmap

    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    async with NixlPeerBackend(listen=f"127.0.0.1:{free_port()}", capacity=64 * 2**20, prefault=prefault) as b:
        arena = b._arena
        assert arena is not None
        start = -(-arena.base // mmap.PAGESIZE) * mmap.PAGESIZE
        nbytes = (arena.base + arena.capacity - start) // mmap.PAGESIZE * mmap.PAGESIZE
        deadline = time.monotonic() + 10
        resident = _resident(start, nbytes)
        while prefault and resident < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
            resident = _resident(start, nbytes)
        assert resident == 1.0 if prefault else resident < 0.1
        assert np.count_nonzero(arena.buffer) == 0  # faulted in, contents untouched
