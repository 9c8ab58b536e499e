"""Mooncake backend throughput against raw Mooncake calls on the same bytes, in the same run.

Usage::

    python benchmarks/storage_mooncake.py [--pages 64] [--layers 30] [--heads 3] [--head-dim 64]
                                          [--page-size 64] [--repeat 3] [--tenant-key KEY]

Starts a ``mooncake_master`` on loopback (free ports, stopped at the end), one client for the raw
calls and one ``MooncakeBackend``. Pages are ``128-byte header + payload`` (fp32 K and V of
``layers x heads x head_dim`` per token, ``page-size`` tokens), the payloads views of one big buffer
like a ``page_first`` host pool. Raw: ``batch_put_from`` / ``batch_get_into`` of each page as one
contiguous region of a registered buffer. Backend: ``MooncakeBackend.set`` / ``get`` of ``PageIO``
pages (its header staging, removal before put, existence probe before get included). Tier:
``StorageTier.store`` / ``fetch`` from and into a ``page_first`` ``HostPool`` (headers encoded and
verified in a worker thread: xxh3-64 checksums, or keyed BLAKE3 MACs with ``--tenant-key``). Best of
``--repeat``; GB = 1e9 B; target ratio backend / raw and tier / raw >= 0.8. Every read is checked bit
for bit.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
try:
    import hicache  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from hicache.keys import TenantKey  # noqa: E402
from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.base import PageIO  # noqa: E402
from hicache.tiers.storage.mooncake import MooncakeBackend  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402
from tests.mooncake_master import start_mooncake  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tenant-key", default="", help="authenticate pages with this key (a MAC per page)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    payload = 2 * args.layers * args.heads * args.head_dim * 4 * args.page_size  # K and V, fp32
    n = args.pages
    total = n * (HEADER_BYTES + payload)
    segment = max(256 * 1024**2, int(total * 3.5 * 1.2))  # raw, backend and tier copies, under the 90% watermark
    server, settings = start_mooncake(Path(tempfile.mkdtemp(prefix="mc-bench-")), global_segment_size=segment,
                                      local_buffer_size=64 * 1024**2)
    try:
        anyio.run(run, args, settings, n, payload, total)
    finally:
        server.stop()
    return 0


async def run(args: argparse.Namespace, settings: dict, n: int, payload: int, total: int) -> None:
    from mooncake.store import MooncakeDistributedStore

    rng = np.random.default_rng(0)
    headers = rng.integers(0, 256, (n, HEADER_BYTES), dtype=np.uint8)
    pool = rng.integers(0, 256, (n, payload), dtype=np.uint8)
    out_headers = np.zeros_like(headers)
    out_pool = np.zeros_like(pool)
    # raw: whole pages contiguous in one registered buffer
    raw_src = np.concatenate([headers, pool], axis=1)
    raw_dst = np.zeros_like(raw_src)
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", settings["metadata_server"], settings["global_segment_size"],
                     settings["local_buffer_size"], "tcp", "", settings["master"]) == 0
    for arr in (raw_src, raw_dst):
        assert raw.register_buffer(int(arr.ctypes.data), arr.nbytes) == 0
    page = HEADER_BYTES + payload
    names = [f"raw/{i}" for i in range(n)]
    src_ptrs = [int(raw_src.ctypes.data) + i * page for i in range(n)]
    dst_ptrs = [int(raw_dst.ctypes.data) + i * page for i in range(n)]
    keys = [i.to_bytes(16, "big") for i in range(n)]
    src = [PageIO(memoryview(headers[i]), (memoryview(pool[i]),)) for i in range(n)]
    dst = [PageIO(memoryview(out_headers[i]), (memoryview(out_pool[i]),)) for i in range(n)]
    best = {"raw put": 0.0, "raw get": 0.0, "backend set": 0.0, "backend get": 0.0, "tier set": 0.0, "tier get": 0.0}
    g = KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, torch.float32)
    assert g.page_bytes == payload
    host = HostPool(g, n * g.page_bytes, layout="page_first", pin_memory=False)
    await host.open()
    host.buffer.view(torch.uint8).view(n, -1).copy_(torch.from_numpy(pool))
    saved = host.page_major().clone()
    codec = PageCodec(b"\x03" * 16, g, TenantKey(args.tenant_key) if args.tenant_key else None)
    tier_keys = [(n + i).to_bytes(16, "big") for i in range(n)]
    async with MooncakeBackend(**{**settings, "key_prefix": "bench", "timeout_s": 60}) as b:
        tier = StorageTier("mooncake", b, codec, host, batch_pages=b.max_batch)  # b is opened above
        for _ in range(args.repeat):
            raw.batch_remove(names, True)
            t = time.perf_counter()
            codes = raw.batch_put_from(names, src_ptrs, [page] * n)
            best["raw put"] = max(best["raw put"], total / (time.perf_counter() - t) / 1e9)
            assert all(c == 0 for c in codes), codes[:4]
            t = time.perf_counter()
            codes = raw.batch_get_into(names, dst_ptrs, [page] * n)
            best["raw get"] = max(best["raw get"], total / (time.perf_counter() - t) / 1e9)
            assert all(c == page for c in codes) and np.array_equal(raw_dst, raw_src)
            raw_dst[:] = 0

            t = time.perf_counter()
            assert await b.set(keys, src) == n
            best["backend set"] = max(best["backend set"], total / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            assert await b.get(keys, dst) == n
            best["backend get"] = max(best["backend get"], total / (time.perf_counter() - t) / 1e9)
            assert np.array_equal(out_pool, pool) and np.array_equal(out_headers, headers)
            out_pool[:] = 0
            out_headers[:] = 0

            t = time.perf_counter()
            assert await tier.store(tier_keys, list(range(n))) == n
            best["tier set"] = max(best["tier set"], total / (time.perf_counter() - t) / 1e9)
            host.buffer.zero_()
            t = time.perf_counter()
            assert await tier.fetch(tier_keys, list(range(n))) == n
            best["tier get"] = max(best["tier get"], total / (time.perf_counter() - t) / 1e9)
            assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), "fetched pages differ"
        s = b.stats()
        assert (s.errors, s.timeouts, s.corrupt_pages, tier.failures) == (0, 0, 0, 0)
    for arr in (raw_src, raw_dst):
        raw.unregister_buffer(int(arr.ctypes.data))
    raw.close()
    mac = "aes-256-gmac (tenant_key)" if args.tenant_key else "xxh3-64 checksum (no key)"
    print(f"{n} pages of {payload / 2**20:.2f} MiB payload + {HEADER_BYTES} B header; tier: {mac}; best of {args.repeat}")
    print(f"{'op':<8}{'raw GB/s':>10}{'backend GB/s':>14}{'ratio':>8}{'tier GB/s':>11}{'ratio':>8}")
    for op, r, k, t in (("put/set", "raw put", "backend set", "tier set"), ("get", "raw get", "backend get", "tier get")):
        print(f"{op:<8}{best[r]:>10.2f}{best[k]:>14.2f}{best[k] / best[r]:>8.2f}{best[t]:>11.2f}{best[t] / best[r]:>8.2f}")


if __name__ == "__main__":
    sys.exit(main())
