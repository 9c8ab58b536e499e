"""``kind: redis`` with ``cluster: true`` against a real three-primary Valkey cluster on loopback.

The contract suite runs against the cluster in ``tests/test_storage_backends.py``; here: pages spread
over the shards, batches split per node and pipelined, ``clear`` on every primary (and its prefix
matched literally, on one server too), two engine processes sharing the cluster, and a primary
killed mid-run and brought back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache import HiCache
from hicache.errors import StorageBackendError
from hicache.tiers.storage.redis import RedisBackend

from .conftest import make_config, make_kv, make_tokens
from .servers import ServerProcess, ValkeyCluster, start_valkey, start_valkey_cluster
from .test_storage_backends import empty, key, page, same

ROOT = Path(__file__).resolve().parent.parent
redis = pytest.importorskip("redis", reason="the redis extra is not installed (pip install hicache[redis])")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    c = start_valkey_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


def backend(c: ValkeyCluster, **kw: object) -> RedisBackend:
    return RedisBackend(url=c.url, cluster=True, key_prefix=kw.pop("key_prefix", f"t{uuid.uuid4().hex[:12]}"),
                        timeout_s=2.0, **kw)


def stats(client: redis.Redis) -> tuple[int, int]:
    """``(commands, read events)`` the node has processed so far (this INFO not included)."""
    info = client.info("stats")
    return info["total_commands_processed"], info["total_reads_processed"]


async def test_pages_spread_over_every_primary(cluster: ValkeyCluster) -> None:
    async with backend(cluster, key_prefix="spread") as b:  # fixed: where each page lands is fixed
        n = 90
        assert await b.set([key(i) for i in range(n)], [page(i) for i in range(n)]) == n
        prefix = b.settings.key_prefix
        counts = []
        for port in cluster.ports:
            with redis.Redis(port=port) as client:
                counts.append(sum(1 for _ in client.scan_iter(match=f"{prefix}:*", count=1000)))
        assert sum(counts) == n
        assert min(counts) >= n // 6, counts  # each shard holds its share (about a third), none is empty
        await b.clear()


async def test_a_batch_is_split_per_node_and_pipelined(cluster: ValkeyCluster) -> None:
    """Each node receives exactly its keys' commands, in a few reads: one pipeline, not a round trip each."""
    async with backend(cluster, key_prefix="split") as b:  # fixed: how many keys each node gets is fixed
        keys = [key(i) for i in range(30)]
        assert await b.set(keys, [page(i) for i in range(30)]) == 30
        # Pages' SETs go through the blocking clients: open the asyncio ones' connections first
        # (their handshake, CLIENT SETINFO, is not the batch's).
        assert await b.exists(keys) == 30
        mine = [sum(cluster.node_of(b._key(k)) == i for k in keys) for i in range(3)]
        clients = [redis.Redis(port=p) for p in cluster.ports]
        before = [stats(c) for c in clients]
        assert await b.exists(keys) == 30
        after = [stats(c) for c in clients]
        for c in clients:
            c.close()
        for i in range(3):
            commands = after[i][0] - before[i][0] - 1  # less the INFO that took `before`
            reads = after[i][1] - before[i][1] - 1
            assert commands == mine[i], (i, commands, mine)
            assert reads <= 2 < mine[i], (i, reads, mine)
        await b.clear()


def names_starting(ports: list[int], prefix: str) -> int:
    """Keys that start with ``prefix``, literally, on all these servers (a full SCAN, no pattern)."""
    count = 0
    for port in ports:
        with redis.Redis(port=port) as client:
            count += sum(1 for name in client.scan_iter(count=1000) if name.startswith(prefix.encode()))
    return count


@pytest.mark.parametrize("mode", ["server", "cluster"])
async def test_clear_matches_the_prefix_literally_on_every_primary(
    mode: str, cluster: ValkeyCluster, tmp_path: Path
) -> None:
    """``team[1]`` is a glob for ``team1``: unescaped, clear deleted another prefix's keys and left its own."""
    server: ServerProcess | None = None
    if mode == "server":
        server = start_valkey(tmp_path)
        ports, url, extra = [server.port], f"redis://127.0.0.1:{server.port}/0", {}
    else:
        ports, url, extra = cluster.ports, cluster.url, {"cluster": True}
    try:
        keys = [key(i) for i in range(12)]
        async with RedisBackend(url=url, key_prefix="team[1]", **extra) as mine, \
                RedisBackend(url=url, key_prefix="team1", **extra) as other:
            await mine.set(keys, [page(i) for i in range(12)])
            await other.set(keys, [page(i) for i in range(12)])
            foreign = {}
            for port in ports:
                with redis.Redis(port=port) as client:
                    name = "someone-else:data"
                    if mode == "cluster":  # someone else's key on this very node
                        name = next(f"x{j}" for j in range(1000) if cluster.node_of(f"x{j}") == ports.index(port))
                    client.set(name, b"keep me")
                    foreign[port] = name
            await mine.clear()
            assert names_starting(ports, "team[1]:") == 0  # its own pages are gone
            assert names_starting(ports, "team1:") == 12  # the other prefix is untouched
            assert await other.exists(keys) == 12
            for port, name in foreign.items():
                with redis.Redis(port=port) as client:
                    assert client.get(name) == b"keep me"
                    client.delete(name)
            await other.clear()
            assert names_starting(ports, "team1:") == 0
    finally:
        if server is not None:
            server.stop()


def test_a_cluster_prefix_with_a_hash_tag_is_refused() -> None:
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match="hash tag"):
        RedisBackend(url="redis://127.0.0.1:1/0", cluster=True, key_prefix="{all}")


async def test_cluster_seeds_find_the_cluster_when_the_urls_node_is_down(cluster: ValkeyCluster) -> None:
    from .servers import free_port

    seeds = [f"127.0.0.1:{p}" for p in cluster.ports[1:]]
    async with backend(cluster, cluster_seeds=seeds) as b:  # the url's node is up: seeds unused
        assert await b.set([key(0)], [page(0)]) == 1
    b = RedisBackend(url=f"redis://127.0.0.1:{free_port()}/0", cluster=True, key_prefix=b.settings.key_prefix,
                     cluster_seeds=seeds, timeout_s=2.0)
    async with b:  # nothing listens at the url: discovered through a seed
        assert await b.exists([key(0)]) == 1
        await b.clear()


def spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.remote_worker", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_engine_process_reuses_the_first_ones_kv(cluster: ValkeyCluster) -> None:
    tier = json.dumps({"kind": "redis", "url": cluster.url, "cluster": True, "key_prefix": f"p{uuid.uuid4().hex[:8]}",
                       "timeout_s": 5.0})
    assert result(spawn("store", tier, "0", "3")) == {"stored_pages": 18, "skipped_pages": 0, "failures": 0}
    checked = result(spawn("check", tier, "0", "3"))  # computed nothing itself: all from the cluster
    assert checked == {"hits": [24, 24, 24], "exact": [True] * 3, "corrupt": 0, "fetched": 18}


async def test_a_dead_primary_costs_its_own_pages_only(cluster: ValkeyCluster) -> None:
    """Backend level: keys on the live nodes are served, the dead node's are not, and a call that
    reaches both returns the pages before the first lost one (the error counted, not raised)."""
    async with backend(cluster) as b:
        keys = [key(i) for i in range(24)]
        assert await b.set(keys, [page(i) for i in range(24)]) == 24
        where = [cluster.node_of(b._key(k)) for k in keys]
        first_lost = next(i for i, w in enumerate(where) if w != where[0])
        dead = where[first_lost]  # a node that holds a page early in the chain, but not the first
        cluster.nodes[dead].kill()
        try:
            started = time.monotonic()
            for i, k in enumerate(keys):
                if where[i] == dead:
                    with pytest.raises(StorageBackendError):
                        await b.exists([k])
                else:
                    assert await b.exists([k]) == 1
                    out = empty(1)
                    assert await b.get([k], out) == 1 and same(out[0], page(i))
            out = empty(24)
            errors = b.stats().errors
            assert await b.get(keys, out) == first_lost
            assert all(same(out[i], page(i)) for i in range(first_lost))
            assert b.stats().errors == errors + 1
            assert time.monotonic() - started < 10  # connection refused: fast, no retry sleeps
        finally:
            cluster.nodes[dead].start()
            cluster.wait_ok()
        # Back, empty (no persistence): its pages are misses, the others still there; writes land again.
        alive = [i for i, w in enumerate(where) if w != dead]
        assert all([await b.exists([keys[i]]) for i in alive])
        deadline = time.monotonic() + 10
        while True:  # the node answers again once it has loaded its cluster config
            try:
                assert await b.exists([keys[first_lost]]) == 0
                break
            except StorageBackendError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert await b.set(keys, [page(i) for i in range(24)]) == 24
        assert await b.exists(keys) == 24
        await b.clear()


def tier_config(c: ValkeyCluster, prefix: str, device_pages: int = 64):
    tier = {"kind": "redis", "url": c.url, "cluster": True, "key_prefix": prefix, "timeout_s": 2.0}
    return make_config(device_pages, 256, tiers={"storage": [tier]},
                       policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4})


async def read_back(cache: HiCache, tokens: list[int], kv: torch.Tensor) -> tuple[int, bool]:
    await cache.lookup(tokens)
    async with cache.retrieve(tokens) as view:
        await view.wait_all()
        exact = all(
            torch.equal(view.layer(layer)[c], kv[c, layer, : view.tokens])
            for layer in range(kv.shape[1]) for c in range(kv.shape[0])
        )
        return view.tokens, exact


async def test_a_primary_killed_mid_run_then_back(cluster: ValkeyCluster) -> None:
    """Cache level: nothing raises while a primary is down; prompts are served up to their first page
    on it; writes go on (those to the dead node counted as failures); once back, the tier is used again."""
    config = tier_config(cluster, "killed-mid-run")  # a fixed prefix: which pages the dead node holds is fixed
    prompts = [(make_tokens(24, seed=40 + i), make_kv(config, 24, seed=40 + i)) for i in range(12)]
    async with HiCache.from_config(config) as cache:
        for tokens, kv in prompts[:8]:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage["redis"].stored_pages == 48
        victim = cluster.nodes[1]
        victim.kill()
        try:
            started = time.monotonic()
            for tokens, kv in prompts[8:10]:  # the engine goes on while a shard is down
                await cache.store(tokens, kv)
                assert await read_back(cache, tokens, kv) == (24, True)  # from memory
            await cache.wait_idle()
            stats = cache.stats().storage["redis"]
            # Counted: a write batch whose first page was on the dead node failed whole (a tier
            # failure); one that reached it later stored the pages before it (a backend error).
            assert stats.failures + stats.backend.errors > 0
            assert 48 <= stats.stored_pages < 48 + 12
            # A fresh engine: storage only. Each prompt is served up to its first page on the dead node.
            async with HiCache.from_config(config) as fresh:
                hits = []
                for tokens, kv in prompts[:8]:
                    got, exact = await read_back(fresh, tokens, kv)
                    assert exact and got % 4 == 0
                    hits.append(got)
                assert 0 < sum(hits) < 8 * 24, hits  # some pages served, the dead node's not
            assert time.monotonic() - started < 20
        finally:
            victim.start()
            cluster.wait_ok()
        for tokens, kv in prompts[10:]:
            await cache.store(tokens, kv)
        await cache.wait_idle()
    time.sleep(1.1)  # past the client's refresh interval
    async with HiCache.from_config(config) as fresh:
        for tokens, kv in prompts[10:]:  # written after the node came back: served whole
            assert await read_back(fresh, tokens, kv) == (24, True)
        assert fresh.stats().storage["redis"].failures == 0


@pytest.mark.parametrize("dead", [0, 1, 2])
async def test_a_fresh_engine_is_served_whatever_primary_is_down(cluster: ValkeyCluster, dead: int) -> None:
    """Each primary killed in turn, then a fresh engine (a new cluster client, as a process that starts
    or restarts meanwhile): each prompt is served exactly up to its first page on the dead node.

    redis-py's ``RedisCluster.initialize()`` sends ``COMMAND`` to its default node, the primary of slot
    0, on every call until it succeeds: with node 0 down a fresh client got 0 tokens for every prompt
    and counted a failure per call, even though ``url`` named a node that was up.
    """
    from hicache.keys import as_token_bytes, chain_keys

    up = (dead + 1) % 3
    prefix = f"each-node-{dead}"  # fixed: which pages land on which node is fixed
    tier = {"kind": "redis", "url": f"redis://127.0.0.1:{cluster.ports[up]}/0", "cluster": True, "key_prefix": prefix,
            "cluster_seeds": [f"127.0.0.1:{p}" for i, p in enumerate(cluster.ports) if i != up], "timeout_s": 2.0}
    config = make_config(64, 256, tiers={"storage": [tier]},
                         policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4})
    prompts = [(make_tokens(24, seed=70 + i), make_kv(config, 24, seed=70 + i)) for i in range(8)]
    async with HiCache.from_config(config) as cache:
        for tokens, kv in prompts:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage["redis"].stored_pages == 48
        seed, codec = cache.controller.tree.seed, cache.controller.storage[0].codec
    expected = []
    for tokens, _ in prompts:
        names = codec.storage_keys(chain_keys(seed, as_token_bytes(tokens), config.page_size))
        nodes = [cluster.node_of(f"{prefix}:{n.hex()}") for n in names]
        expected.append(config.page_size * (nodes.index(dead) if dead in nodes else len(nodes)))
    assert 0 < sum(expected) < 8 * 24, expected  # some prompts reach the dead node, not all at their first page
    victim = cluster.nodes[dead]
    victim.kill()
    try:
        started = time.monotonic()
        async with HiCache.from_config(config) as fresh:
            got = []
            for tokens, kv in prompts:
                n, exact = await read_back(fresh, tokens, kv)
                assert exact
                got.append(n)
            failures = fresh.stats().storage["redis"].failures
        assert got == expected
        # A failure only for a call whose first page is on the dead node (lookup's probe, prefetch's read).
        assert failures <= 2 * sum(e == 0 for e in expected), failures
        assert time.monotonic() - started < 20
    finally:
        victim.start()
        cluster.wait_ok()
