"""The Mooncake Store backend against a real ``mooncake_master`` (loopback, free ports, stopped by PID).

The backend contract suite runs against Mooncake in ``tests/test_storage_backends.py``; here are
what is particular to it: zero-copy registration, lost objects, a master killed and back, and two
processes sharing one cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hicache.errors import StorageError  # noqa: E402
from hicache.tiers.storage import HEADER_BYTES, PageIO  # noqa: E402
from hicache.tiers.storage.mooncake import MooncakeBackend  # noqa: E402
from tests.mooncake_master import start_mooncake  # noqa: E402
from tests.servers import ServerProcess  # noqa: E402
from tests.test_storage_backends import BackendFactory, empty, key, page, same  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, Any]]]:
    server, settings = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    try:
        yield server, settings
    finally:
        server.stop()


def fresh(settings: dict[str, Any], **kw: Any) -> MooncakeBackend:
    """A backend in its own key namespace, so tests sharing the master do not see each other's pages."""
    return MooncakeBackend(**{"key_prefix": f"t{uuid.uuid4().hex[:12]}", "register_min": 256 * 1024,
                              "staging_size": 4 * 1024**2, **settings, **kw})


@pytest.fixture
def backend_factory(mooncake: tuple[ServerProcess, dict[str, Any]]) -> BackendFactory:
    return lambda **kw: fresh(mooncake[1], **kw)


async def test_clear_removes_this_prefix_only(backend_factory: BackendFactory) -> None:
    async with backend_factory() as b, backend_factory() as other:
        keys = [key(i) for i in range(4)]
        await b.set(keys, [page(i) for i in range(4)])
        await other.set(keys, [page(i) for i in range(4)])
        await b.clear()
        assert await b.exists(keys) == 0
        assert await other.exists(keys) == 4
        assert b.stats().errors == 0


# -- Mooncake specifics --------------------------------------------------------------------------


def pool_pages(n: int, payload: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[PageIO]]:
    """Pages whose payloads are views into one big buffer (a ``page_first`` host pool)."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, (n, payload), dtype=np.uint8)
    headers = rng.integers(0, 256, (n, HEADER_BYTES), dtype=np.uint8)
    return pool, headers, [PageIO(memoryview(headers[i]), (memoryview(pool[i]),)) for i in range(n)]


async def test_zero_copy_round_trip_from_one_big_buffer(backend_factory: BackendFactory) -> None:
    n, payload = 8, 64 * 1024
    src_pool, _, src = pool_pages(n, payload, seed=1)
    dst_pool, _, dst = pool_pages(n, payload, seed=2)
    keys = [key(i) for i in range(n)]
    async with backend_factory() as b:
        assert await b.set(keys, src) == n
        assert await b.get(keys, dst) == n
        assert all(same(dst[i], src[i]) for i in range(n))
        # both pools were used in place: registered whole, next to the staging arena (headers)
        registered = set(b._registered)
        assert {int(src_pool.ctypes.data), int(dst_pool.ctypes.data)} <= registered
        assert len(registered) == 3  # source pool, destination pool, staging arena


async def test_layer_first_pieces_in_place_and_split_pieces_staged(backend_factory: BackendFactory) -> None:
    """Pieces that are strided views of a big buffer (``layer_first``) and small loose pieces both round-trip."""
    n, chunks, chunk = 4, 6, 8 * 1024
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 256, (chunks, n, chunk), dtype=np.uint8)  # [C*L, pages, chunk]
    pieces = pool.transpose(1, 0, 2)
    headers = rng.integers(0, 256, (n, HEADER_BYTES), dtype=np.uint8)
    src = [PageIO(memoryview(headers[i]), tuple(memoryview(p) for p in pieces[i])) for i in range(n)]
    keys = [key(i) for i in range(n)]
    async with backend_factory() as b:
        assert await b.set(keys, src) == n
        out = [PageIO.of(np.zeros(HEADER_BYTES, np.uint8), *np.split(np.zeros(chunks * chunk, np.uint8), [100, 5000]))
               for _ in range(n)]  # small loose buffers: the staging path
        assert await b.get(keys, out) == n
        assert all(same(out[i], src[i]) for i in range(n))


async def test_removed_on_the_server_is_a_miss(backend_factory: BackendFactory, mooncake: Any) -> None:
    from mooncake.store import MooncakeDistributedStore

    settings = mooncake[1]
    async with backend_factory() as b:
        keys = [key(i) for i in range(4)]
        assert await b.set(keys, [page(i) for i in range(4)]) == 4
        other = MooncakeDistributedStore()  # another client removes page 2, as an eviction would
        assert other.setup("127.0.0.1", settings["metadata_server"], 16 * 1024**2, 16 * 1024**2, "tcp", "",
                           settings["master"]) == 0
        try:
            assert other.remove(f"{b.settings.key_prefix}/{key(2).hex()}", True) == 0
        finally:
            other.close()
        assert await b.exists(keys) == 2
        out = empty(4)
        assert await b.get(keys, out) == 2
        assert same(out[1], page(1))
        assert (b.stats().errors, b.stats().timeouts) == (0, 0)


async def test_master_killed_then_back(tmp_path: Path) -> None:
    server, settings = start_mooncake(tmp_path)
    try:
        async with fresh(settings, timeout_s=2.0) as b:
            keys = [key(i) for i in range(3)]
            assert await b.set(keys, [page(i) for i in range(3)]) == 3
            server.kill()
            for verb in ("set", "get", "exists", "get"):
                start = time.monotonic()
                with pytest.raises(StorageError):
                    if verb == "set":
                        await b.set([key(7)], [page(7)])
                    elif verb == "get":
                        await b.get(keys, empty(3))
                    else:
                        await b.exists(keys)
                assert time.monotonic() - start < 2.0 + 1.0, verb  # timeout_s, plus slack
            server.start()
            deadline = time.monotonic() + 20
            while True:  # the client notices the master is back within a few seconds
                try:
                    if await b.set([key(5)], [page(5)]) == 1:
                        break
                except StorageError:
                    pass
                assert time.monotonic() < deadline, "the backend did not recover"
                time.sleep(0.3)
            out = empty(1)
            assert await b.get([key(5)], out) == 1 and same(out[0], page(5))
            assert await b.exists(keys) == 0  # the new master knows nothing of the old objects: misses
            assert b.stats().errors + b.stats().timeouts >= 4
    finally:
        server.stop()


WRITER = textwrap.dedent(
    """
    import asyncio, json, sys
    from hicache.tiers.storage.mooncake import MooncakeBackend
    from tests.test_storage_backends import key, page

    async def main():
        async with MooncakeBackend(**json.loads(sys.argv[1])) as b:
            n = await b.set([key(i) for i in range(6)], [page(i, salt=9) for i in range(6)])
            print(f"stored {n}", flush=True)
            sys.stdin.readline()  # keep the segment (and the data in it) alive until told

    asyncio.run(main())
    """
)


async def test_prefer_local_segment_puts_pages_into_the_writers_own_segment(mooncake: Any) -> None:
    # Two clients lend segments; the master spreads a default client's puts over both, and puts
    # a prefer_local_segment client's into its own (a prefill server's hand-offs: a local copy).
    def where(backend: MooncakeBackend, keys: list[bytes]) -> set[str]:
        return {backend._store.get_replica_desc(backend._name(k))[0].get_memory_descriptor()
                .buffer_descriptor.transport_endpoint for k in keys}

    keys = [key(i) for i in range(16)]
    async with fresh(mooncake[1]) as spread, fresh(mooncake[1], prefer_local_segment=True) as local:
        assert await local.set(keys, [page(i) for i in range(16)]) == 16
        assert where(local, keys) == {local._store.get_hostname()}
        out = empty(16)
        assert await spread.get([k for k in keys], out) == 0  # other key prefixes: nothing shared
        assert await spread.set(keys, [page(i, salt=3) for i in range(16)]) == 16
        assert len(where(spread, keys)) > 1  # the default: both segments
        assert await local.get(keys, out) == 16 and all(same(out[i], page(i)) for i in range(16))


async def test_two_processes_share_one_cluster(mooncake: Any) -> None:
    import json

    settings = {**mooncake[1], "key_prefix": f"x{uuid.uuid4().hex[:8]}"}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(settings)], cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "stored 6"
        async with MooncakeBackend(**settings) as reader:
            keys = [key(i) for i in range(6)]
            assert await reader.exists(keys) == 6
            out = empty(6)
            assert await reader.get(keys, out) == 6
            assert all(same(out[i], page(i, salt=9)) for i in range(6))
        writer.stdin.write("done\n")
        writer.stdin.flush()
        assert writer.wait(timeout=30) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        for pipe in (writer.stdin, writer.stdout):
            if pipe is not None:
                pipe.close()


def test_a_second_engine_process_reuses_the_first_ones_kv_through_the_cluster(mooncake: Any) -> None:
    """Two engine processes (HiCache with a Mooncake tier): the second computes nothing itself."""
    import json

    tier = json.dumps({"kind": "mooncake", **mooncake[1], "key_prefix": f"e{uuid.uuid4().hex[:8]}", "timeout_s": 5.0})
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}

    def spawn(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "tests.remote_worker", *args], cwd=REPO, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    writer = spawn("store", tier, "0", "3", "--hold")  # stays alive: its segment holds the pages
    try:
        assert writer.stdout is not None
        stored = json.loads(writer.stdout.readline())
        assert stored == {"stored_pages": 18, "skipped_pages": 0, "failures": 0}
        reader = spawn("check", tier, "0", "3")
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        checked = json.loads(out.strip().splitlines()[-1])
        assert checked == {"hits": [24, 24, 24], "exact": [True] * 3, "corrupt": 0, "fetched": 18}
    finally:
        writer.communicate(input="", timeout=60)


async def test_requests_go_on_while_the_master_is_down_and_the_tier_is_used_again(tmp_path: Path) -> None:
    """Through the cache: a killed master costs counted failures, never a hang or wrong data."""
    import anyio

    from hicache import HiCache
    from tests.conftest import make_config, make_kv, make_tokens
    from tests.test_redis_tier import read_back

    server, settings = start_mooncake(tmp_path)
    tier = {"kind": "mooncake", **settings, "timeout_s": 2.0}
    config = make_config(8, 256, tiers={"storage": [tier]},
                         policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4})
    prompts = [(make_tokens(24, seed=40 + i), make_kv(config, 24, seed=40 + i)) for i in range(8)]
    try:
        async with HiCache.from_config(config) as cache:
            server.kill()
            started = time.monotonic()
            for tokens, kv in prompts[:2]:
                await cache.store(tokens, kv)
                assert await read_back(cache, tokens, kv) == (24, True)  # from memory
            await cache.wait_idle()
            assert time.monotonic() - started < 30
            down = cache.stats().storage["mooncake"]
            assert down.failures > 0 and down.stored_pages == 0
            server.start()
            deadline = time.monotonic() + 30
            seed = 100
            while not cache.stats().storage["mooncake"].stored_pages and time.monotonic() < deadline:
                seed += 1  # new prompts until the tier takes them again: no restart of the cache
                await cache.store(make_tokens(24, seed=seed), make_kv(config, 24, seed=seed))
                await cache.wait_idle()
                await anyio.sleep(0.5)
            assert cache.stats().storage["mooncake"].stored_pages > 0, time.monotonic() - started
    finally:
        server.stop()


async def test_a_master_started_with_a_longer_client_ttl_serves_pages(tmp_path: Path) -> None:
    """``hicache bench pd`` starts its master with ``--client_ttl`` (a stalled client keeps its
    segment): the wheel's master accepts the flag (it exits on one it does not know) and serves."""
    from hicache.soak.servers import start_mooncake_master
    from tests.servers import mooncake_master_binary, unavailable
    from tests.test_storage_backends import test_set_then_get_is_bit_exact

    binary = mooncake_master_binary()
    if binary is None:
        unavailable("no mooncake_master binary (pip install mooncake-transfer-engine-non-cuda)")
        return
    master = start_mooncake_master(binary, tmp_path, client_ttl_s=60)
    try:
        assert "--client_ttl=60" in master.server.argv
        settings = {"master": f"127.0.0.1:{master.rpc_port}", "protocol": "tcp", "local_hostname": "127.0.0.1",
                    "metadata_server": f"http://127.0.0.1:{master.http_port}/metadata",
                    "global_segment_size": 64 * 1024**2, "local_buffer_size": 16 * 1024**2}
        await test_set_then_get_is_bit_exact(lambda **kw: fresh(settings, **kw))
        assert master.server.proc is not None and master.server.proc.poll() is None
    finally:
        master.server.stop()
