"""The codec axis of the storage benchmarks: bytes per page and a tier's logical GB/s, per codec chain.

Usage (also ``python benchmarks/storage.py --codecs ...``, which runs this with its arguments)::

    python benchmarks/storage_codecs.py [--backend file|redis|s3] [--codecs none,lossless,int8,aes-gcm,lossless+aes-gcm]
                                        [--dtype bfloat16] [--pages 64] [--repeat 3] [--kv real|random]
                                        [--tenant-key KEY] [--threads N] [--json out.json]

Pages are real KV (``--kv real``: SmolLM2-135M over English text, ``benchmarks/page_codecs.py``;
30 layers x 3 KV heads x 64 dims, 64 tokens a page) cast to ``--dtype``, tiled to ``--pages`` pages;
``--kv random`` uses normal noise instead (no model needed). For each chain (``+`` joins stages;
``none`` is the plain tier) it times, in one run, alternating so noise hits all alike:

* ``write``: ``StorageTier.store`` of every page into an emptied store (encode, check value, backend);
* ``read``: ``StorageTier.fetch`` of every page into a zeroed host pool (backend, check, decode),
  cold for the file tier (page cache dropped with ``posix_fadvise``);

and the **raw operation** on the logical bytes (``header + KV`` per page, no codec, no check): for
``file`` one file written sequentially into the page cache and read back cold (``storage.py``'s
denominator); for ``redis`` pipelined ``SET``/``GET`` through redis-py (a ``valkey-server`` it starts on
loopback); for ``s3`` concurrent ``PUT``/``GET`` through obstore (a SeaweedFS it starts on loopback).

Per chain it prints the stored bytes per page (and logical / stored), and write and read GB/s of
**logical** KV (pages x page bytes / seconds), median of ``--repeat``, with the ratios to the raw
operation and to the ``none`` chain of the same run. GB = 1e9 B. Every read is checked: bit for bit
for lossless chains, within int8's error for lossy ones; the tier's error and corrupt counters must
stay at zero. These machines are shared: record /proc/pressure/cpu with the numbers.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.servers: the server launchers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hicache.config import CodecConfig  # noqa: E402
from hicache.keys import TenantKey  # noqa: E402
from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.codecs import build_chain  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402

NS = b"\x07" * 16
OWN_KEY = "benchmark-page-key-0123456789"  # aes-gcm's key when no --tenant-key is given


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().strip().splitlines()[0]
    except OSError:
        return "(unreadable)"


def kv_pages(kind: str, pages: int, dtype: torch.dtype) -> torch.Tensor:
    """``[pages, 2, 30, 64, 3, 64]`` of ``dtype``: SmolLM2's KV tiled, or normal noise."""
    if kind == "random":
        g = torch.Generator().manual_seed(0)
        return torch.randn((pages, 2, 30, 64, 3, 64), generator=g).to(dtype)
    from page_codecs import as_pages, real_kv

    _, _, keys, values = real_kv(1024)
    real = as_pages(keys, values, 64)
    reps = -(-pages // real.shape[0])
    return real.repeat(reps, 1, 1, 1, 1, 1)[:pages].to(dtype).contiguous()


def chain_of(spec: str, geometry: KVGeometry, tenant: TenantKey | None) -> PageCodec:
    stages = [] if spec == "none" else spec.split("+")
    entries = [CodecConfig.model_validate({"kind": "aes-gcm", "key": OWN_KEY} if s == "aes-gcm" and tenant is None
                                          else s) for s in stages]
    secret = tenant.derive("page-aead") if tenant is not None else None
    return PageCodec(NS, geometry, tenant, chain=build_chain(entries, geometry=geometry, namespace=NS,
                                                               tenant_secret=secret))


# --------------------------------------------------------------------------- the raw operations


class RawFile:
    def __init__(self, root: Path) -> None:
        self.path = root / "raw.bin"

    async def write(self, values: list[np.ndarray]) -> float:
        from storage_common import raw_write

        self.path.unlink(missing_ok=True)
        header = values[0][:HEADER_BYTES]
        body = np.stack([v[HEADER_BYTES:] for v in values])
        return raw_write(self.path, header, body, False)

    async def read(self, values: list[np.ndarray]) -> float:
        from storage_common import raw_read

        into = np.empty((len(values), values[0].nbytes - HEADER_BYTES), np.uint8)
        into.fill(0)
        return raw_read(self.path, np.zeros(HEADER_BYTES, np.uint8), into)


class RawRedis:
    def __init__(self, url: str, batch: int) -> None:
        import redis.asyncio as redis

        self.client = redis.Redis.from_url(url, socket_timeout=60)
        self.batch = batch
        self.names: list[bytes] = []

    async def write(self, values: list[np.ndarray]) -> float:
        self.names = [f"bench-raw:{uuid.uuid4().hex}".encode() for _ in values]
        blobs = [v.tobytes() for v in values]
        t0 = time.perf_counter()
        for s in range(0, len(blobs), self.batch):
            async with self.client.pipeline(transaction=False) as pipe:
                for name, blob in zip(self.names[s : s + self.batch], blobs[s : s + self.batch], strict=True):
                    pipe.set(name, blob)
                await pipe.execute()
        return time.perf_counter() - t0

    async def read(self, values: list[np.ndarray]) -> float:
        t0 = time.perf_counter()
        for s in range(0, len(self.names), self.batch):
            async with self.client.pipeline(transaction=False) as pipe:
                for name in self.names[s : s + self.batch]:
                    pipe.get(name)
                got = await pipe.execute()
            assert all(len(g) == len(values[0]) for g in got)
        elapsed = time.perf_counter() - t0
        await self.client.delete(*self.names)
        return elapsed


class RawS3:
    def __init__(self, server: Any, concurrency: int) -> None:
        self.store = server.raw_store(client_options={"allow_http": True, "timeout": "120s"})
        self.concurrency = concurrency
        self.names: list[str] = []

    async def _each(self, n: int, fn: Any) -> float:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> None:
            async with sem:
                await fn(i)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0

    async def write(self, values: list[np.ndarray]) -> float:
        import obstore

        self.names = [f"bench-raw/{uuid.uuid4().hex}" for _ in values]
        blobs = [v.tobytes() for v in values]
        return await self._each(len(values), lambda i: obstore.put_async(self.store, self.names[i], blobs[i],
                                                                         use_multipart=False))

    async def read(self, values: list[np.ndarray]) -> float:
        import obstore

        async def get(i: int) -> None:
            blob = await (await obstore.get_async(self.store, self.names[i])).bytes_async()
            assert len(blob) == len(values[i])

        elapsed = await self._each(len(values), get)
        await obstore.delete_async(self.store, self.names)
        return elapsed


# --------------------------------------------------------------------------- the run


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    g = KVGeometry(2, 30, 64, 3, 64, dtype)
    data = kv_pages(args.kv, args.pages, dtype)
    n = args.pages
    host = HostPool(g, n * g.page_bytes, layout="page_first", pin_memory=False)
    await host.open()
    host.page_major().copy_(data.reshape(host.page_major().shape))
    saved = host.page_major().clone()
    values = [np.concatenate([np.zeros(HEADER_BYTES, np.uint8), saved[i].view(torch.uint8).numpy().reshape(-1)])
              for i in range(n)]
    tenant = TenantKey(args.tenant_key) if args.tenant_key else None
    chains = args.codecs.split(",")
    stop: list[Any] = []
    if args.backend == "file":
        from hicache.tiers.storage.file import FileBackend

        make = lambda spec: FileBackend(path=str(workdir / f"tier-{spec}"), fsync="never",  # noqa: E731
                                        capacity=64 * 2**30)
        raw: Any = RawFile(workdir)
    elif args.backend == "redis":
        from hicache.tiers.storage.redis import RedisBackend
        from tests.servers import start_valkey

        (workdir / "valkey").mkdir()
        server = start_valkey(workdir / "valkey")
        stop.append(server)
        url = f"redis://127.0.0.1:{server.port}/0"
        make = lambda spec: RedisBackend(url=url, key_prefix=f"bench-{spec}", timeout_s=120)  # noqa: E731
        raw = RawRedis(url, RedisBackend.max_batch)
    else:
        from hicache.tiers.storage.s3 import S3Backend
        from tests.servers import start_seaweedfs

        (workdir / "s3").mkdir(exist_ok=True)
        server = start_seaweedfs(workdir / "s3")
        stop.append(server)
        make = lambda spec: S3Backend(**server.settings(key_prefix=f"bench-{spec.replace('+', '-')}",  # noqa: E731
                                                        timeout_s=120))
        raw = RawS3(server, S3Backend.Settings.model_fields["max_concurrency"].default)
    times: dict[str, dict[str, list[float]]] = {name: {"write": [], "read": []} for name in ["raw", *chains]}
    stored: dict[str, float] = {}
    errors: dict[str, float] = {}
    try:
        tiers = {}
        for spec in chains:
            backend = make(spec)
            tiers[spec] = StorageTier(spec, backend, chain_of(spec, g, tenant), host,
                                      batch_pages=max(1, (64 * 2**20) // g.page_bytes), codec_threads=args.threads)
            await tiers[spec].__aenter__()
        for _ in range(args.repeat):
            times["raw"]["write"].append(await raw.write(values))
            times["raw"]["read"].append(await raw.read(values))
            for spec, tier in tiers.items():
                await tier.backend.clear()
                keys = [os.urandom(16) for _ in range(n)]
                host.page_major().copy_(saved)
                before = tier.stats().codec
                t0 = time.perf_counter()
                assert await tier.store(keys, list(range(n))) == n
                times[spec]["write"].append(time.perf_counter() - t0)
                after = tier.stats().codec
                stored[spec] = (after.encoded_stored_bytes - before.encoded_stored_bytes) / n + HEADER_BYTES \
                    if tier.codec.encoded else g.page_bytes + HEADER_BYTES
                if args.backend == "file":
                    from storage_common import fsync

                    for name in tier.codec.storage_keys(keys):
                        fsync(tier.backend.path_of(name), drop_cache=True)  # type: ignore[attr-defined]
                host.buffer.zero_()
                t0 = time.perf_counter()
                assert await tier.fetch(keys, list(range(n))) == n
                times[spec]["read"].append(time.perf_counter() - t0)
                got = host.page_major()
                if "int8" in spec:
                    errors[spec] = float((got.float() - saved.float()).norm() / saved.float().norm())
                    assert errors[spec] < 0.02, errors[spec]
                else:
                    assert torch.equal(got.view(torch.uint8), saved.view(torch.uint8)), spec
        for spec, tier in tiers.items():
            st = tier.backend.stats()
            assert st.errors == st.timeouts == st.corrupt_pages == 0 and tier.failures == 0, (spec, st)
            await tier.backend.clear()
            await tier.__aexit__(None, None, None)
    finally:
        for server in stop:
            server.stop()
    logical = n * g.page_bytes
    rows: dict[str, dict[str, float]] = {}
    raw_w, raw_r = (statistics.median(times["raw"][op]) for op in ("write", "read"))
    for spec in chains:
        w, r = statistics.median(times[spec]["write"]), statistics.median(times[spec]["read"])
        rows[spec] = {
            "stored_bytes_per_page": stored[spec], "ratio": (g.page_bytes + HEADER_BYTES) / stored[spec],
            "write_gbps": logical / w / 1e9, "read_gbps": logical / r / 1e9,
            "write_vs_raw": raw_w / w, "read_vs_raw": raw_r / r,
            "write_vs_none": (statistics.median(times["none"]["write"]) / w) if "none" in times else float("nan"),
            "read_vs_none": (statistics.median(times["none"]["read"]) / r) if "none" in times else float("nan"),
            **({"rel_error": errors[spec]} if spec in errors else {}),
        }
    return {"backend": args.backend, "dtype": args.dtype, "kv": args.kv, "pages": n, "page_bytes": g.page_bytes,
            "tenant_key": bool(tenant), "raw_write_gbps": logical / raw_w / 1e9, "raw_read_gbps": logical / raw_r / 1e9,
            "rows": rows, "seconds": times}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="file", choices=["file", "redis", "s3"])
    p.add_argument("--codecs", default="none,lossless,int8,int8+lossless,aes-gcm,lossless+aes-gcm")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv", default="real", choices=["real", "random"])
    p.add_argument("--tenant-key", default="", help="a tenant key: MACs (or the AEAD) on every page")
    p.add_argument("--threads", type=int, default=None, help="the tier's codec threads (default: its own)")
    p.add_argument("--dir", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.threads is None:
        from hicache.tiers.storage.tier import DEFAULT_CODEC_THREADS

        args.threads = DEFAULT_CODEC_THREADS
    torch.set_num_threads(1)
    start = cpu_pressure()
    workdir = Path(tempfile.mkdtemp(prefix="hicache-codecs-", dir=args.dir))
    try:
        result = anyio.run(measure, args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    end = cpu_pressure()
    print(f"\n{args.backend} tier, {result['pages']} pages of {result['page_bytes'] / 2**20:.2f} MiB {args.dtype} KV "
          f"({args.kv}), tenant key {'on' if result['tenant_key'] else 'off'}, median of {args.repeat}; raw "
          f"write {result['raw_write_gbps']:.2f} GB/s, read {result['raw_read_gbps']:.2f} GB/s")
    head = (f"{'codec':<20} {'bytes/page':>11} {'ratio':>6} {'write GB/s':>10} {'x raw':>6} {'x none':>6} "
            f"{'read GB/s':>9} {'x raw':>6} {'x none':>6}")
    print(head)
    for spec, r in result["rows"].items():
        print(f"{spec:<20} {r['stored_bytes_per_page']:>11.0f} {r['ratio']:>6.2f} {r['write_gbps']:>10.2f} "
              f"{r['write_vs_raw']:>6.2f} {r['write_vs_none']:>6.2f} {r['read_gbps']:>9.2f} {r['read_vs_raw']:>6.2f} "
              f"{r['read_vs_none']:>6.2f}")
    print(f"cpu pressure at start: {start}\ncpu pressure at end:   {end}")
    if args.json:
        args.json.write_text(json.dumps({**result, "cpu_pressure_start": start, "cpu_pressure_end": end}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
