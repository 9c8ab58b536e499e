"""File-tier write and cold-read throughput, as a ratio to the raw operation on the same bytes in the same run.

Usage (``--backend redis`` / ``mooncake`` / ``s3`` / ``redis-cluster`` / ``nixl`` / ``nixl-peer`` run
``storage_redis.py`` / ``storage_mooncake.py`` / ``storage_s3.py`` / ``storage_redis_cluster.py`` /
``storage_nixl.py`` / ``storage_nixl_peer.py``, the other tiers' benchmarks, with the other arguments)::

    python benchmarks/storage.py --codecs none,lossless,int8,aes-gcm [--backend file|redis|s3] ...  # the codec axis
    python benchmarks/storage.py [--backend file|redis|mooncake|s3|redis-cluster|nixl|nixl-peer] [--pages 256] [--layers 30] [--heads 3] [--head-dim 64] [--page-size 64]
                                 [--dtype float32] [--repeat 3] [--dir DIR] [--host-layout page_first|layer_first]
                                 [--fsync always|never] [--tenant-key KEY] [--json out.json]

Builds the real components (``HostPool``, ``FileBackend``, ``PageCodec``, ``StorageTier``; no cache,
no controller) and times, on ``--pages`` pages of random KV:

* ``write``: ``StorageTier.store`` of every page into an emptied directory (headers and xxh3
  checksums, or with ``--tenant-key`` keyed BLAKE3 MACs, encoded in a worker thread, one file per
  page: temporary file, fsync, rename);
* ``read``: ``StorageTier.fetch`` of every page, cold, into a zeroed host pool (read, then every
  header and checksum verified; a ``layer_first`` pool goes through the tier's staging buffer).

The denominators move the same bytes (``pages x (128-byte header + payload)``) the plain way: one
file written sequentially with ``os.write`` (header, payload, header, ...) and one ``fsync`` at the
end (none under ``--fsync never``), then read back cold with ``os.readv`` into preallocated,
pre-faulted buffers. "Cold" means the page cache of every file was dropped first with ``fsync`` +
``posix_fadvise(DONTNEED)``, which needs no privileges. Raw and tier runs alternate (raw write, tier
write, raw read, tier read, per repetition) so machine noise hits both; the table gives the best and
the median GB/s of each and the ratios tier / raw of the bests and of the medians (target: >= 0.8).
Outside the timed regions every read is checked bit for bit against the pages written, and the
backend's error and corrupt-page counters must stay at zero.

GB = 1e9 B. Record /proc/pressure/cpu with the numbers: these machines are shared.
"""

from __future__ import annotations

import os

# Before torch is imported: idle OpenMP workers must not spin on a 2-vCPU machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hicache.keys import TenantKey  # noqa: E402
from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.file import FileBackend  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return "(unreadable)"


def fsync(path: Path, drop_cache: bool = False) -> None:
    """fsync a file or folder; with ``drop_cache``, then evict the file from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, header: np.ndarray, pages: np.ndarray, sync: bool) -> float:
    """One file: header + payload per page with ``os.write``, one fsync at the end; seconds."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        for page in pages:
            written += os.write(fd, header) + os.write(fd, page)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    assert written == len(pages) * (HEADER_BYTES + pages.shape[1]), "short raw write"
    return elapsed


def raw_read(path: Path, header: np.ndarray, into: np.ndarray) -> float:
    """Read the raw file back cold, page by page, with ``os.readv``; seconds."""
    fsync(path, drop_cache=True)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        got = sum(os.readv(fd, [header, page]) for page in into)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    assert got == len(into) * (HEADER_BYTES + into.shape[1]), "short raw read"
    return elapsed


async def measure(args: argparse.Namespace, root: Path) -> tuple[dict[str, dict[str, list[float]]], dict]:
    g = KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, getattr(torch, args.dtype))
    n = args.pages
    host = HostPool(g, n * g.page_bytes, layout=args.host_layout, pin_memory=False)
    await host.open()
    host.buffer.view(-1).uniform_()  # writes every byte: the pool is pre-faulted
    saved = host.page_major().clone(memory_format=torch.contiguous_format)  # what every read must give back
    saved_bytes = saved.view(torch.uint8).view(n, -1).numpy()  # raw write source: the same page payloads
    host_bytes = host.buffer.view(torch.uint8).view(n, -1).numpy()  # raw read destination (pre-faulted)
    raw_header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    raw_file = root / "raw.bin"

    backend = FileBackend(
        path=str(root / "tier"), capacity=max(64 * 2**30, 2 * n * (HEADER_BYTES + g.page_bytes)), fsync=args.fsync
    )
    key = TenantKey(args.tenant_key) if args.tenant_key else None
    codec = PageCodec(namespace=b"\x01" * 16, geometry=g, tenant_key=key)
    tier = StorageTier("file", backend, codec, host, batch_pages=max(1, (64 * 2**20) // g.page_bytes))
    host_pages = list(range(n))
    times: dict[str, dict[str, list[float]]] = {op: {"raw": [], "hicache": []} for op in ("write", "read")}
    # CPU seconds of the whole process (every thread) per operation: steadier than wall time on a
    # shared machine, and what the tier costs beyond the raw operation.
    cpu: dict[str, dict[str, list[float]]] = {op: {"raw": [], "hicache": []} for op in ("write", "read")}

    async with tier:
        for _ in tqdm(range(args.repeat), desc="repetitions", file=sys.stderr, leave=False):
            # Fresh files for both, deletions made durable before the clocks start.
            raw_file.unlink(missing_ok=True)
            await backend.clear()
            fsync(root)
            keys = [os.urandom(16) for _ in range(n)]

            c0 = time.process_time()
            times["write"]["raw"].append(raw_write(raw_file, raw_header, saved_bytes, args.fsync == "always"))
            cpu["write"]["raw"].append(time.process_time() - c0)
            t0, c0 = time.perf_counter(), time.process_time()
            written = await tier.store(keys, host_pages)
            times["write"]["hicache"].append(time.perf_counter() - t0)
            cpu["write"]["hicache"].append(time.process_time() - c0)
            assert written == n, f"store wrote {written} of {n} pages"

            c0 = time.process_time()
            times["read"]["raw"].append(raw_read(raw_file, raw_header, host_bytes))
            cpu["read"]["raw"].append(time.process_time() - c0)
            assert np.array_equal(host_bytes, saved_bytes), "raw read differs from the bytes written"

            host.buffer.zero_()
            for name in codec.storage_keys(keys):  # the files are named by the codec (keyed names with a key)
                fsync(backend.path_of(name), drop_cache=True)
            t0, c0 = time.perf_counter(), time.process_time()
            got = await tier.fetch(keys, host_pages)
            times["read"]["hicache"].append(time.perf_counter() - t0)
            cpu["read"]["hicache"].append(time.process_time() - c0)
            assert got == n, f"fetch verified {got} of {n} pages"
            assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), "fetched pages differ"
        stats = backend.stats()
    assert stats.errors == 0 and stats.timeouts == 0 and stats.corrupt_pages == 0 and tier.failures == 0, stats
    meta = {
        "geometry": {
            "components": g.components, "layers": g.num_layers, "page_size": g.page_size,
            "heads": g.num_kv_heads, "head_dim": g.head_dim, "dtype": args.dtype,
        },
        "page_bytes": g.page_bytes,
        "pages": n,
        "op_bytes": n * (HEADER_BYTES + g.page_bytes),
        "host_layout": args.host_layout,
        "fsync": args.fsync,
        "repeat": args.repeat,
        "mac": "blake3 keyed (tenant_key)" if args.tenant_key else "xxh3-64 checksum (no key)",
        "cpu_seconds": cpu,
        "backend_stats": {
            "pages_written": stats.pages_written, "pages_read": stats.pages_read, "errors": stats.errors,
            "timeouts": stats.timeouts, "corrupt_pages": stats.corrupt_pages, "tier_failures": tier.failures,
        },
    }
    return times, meta


def summarize(times: dict[str, dict[str, list[float]]], op_bytes: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for op, by_path in times.items():
        row: dict[str, float] = {}
        for path, secs in by_path.items():
            gbps = [op_bytes / s / 1e9 for s in secs]
            row[f"{path}_best"], row[f"{path}_median"] = max(gbps), statistics.median(gbps)
        row["ratio_best"] = row["hicache_best"] / row["raw_best"]
        row["ratio_median"] = row["hicache_median"] / row["raw_median"]
        out[op] = row
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The codec axis (bytes per page, logical GB/s per codec chain, for file, redis and s3) is
    # benchmarks/storage_codecs.py: `--codecs none,lossless,...` runs it with the other arguments.
    if any(a == "--codecs" or a.startswith("--codecs=") for a in argv):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        return __import__("storage_codecs").main(argv)
    # The shared tiers have their own scripts (a server to start, a raw client to compare with);
    # `--backend redis|mooncake|s3|redis-cluster` runs them with the remaining arguments.
    if "--backend" in argv:
        i = argv.index("--backend")
        backend, rest = argv[i + 1] if i + 1 < len(argv) else "", argv[:i] + argv[i + 2 :]
        scripts = {"redis": "storage_redis", "mooncake": "storage_mooncake", "s3": "storage_s3",
                   "redis-cluster": "storage_redis_cluster", "nixl": "storage_nixl", "nixl-peer": "storage_nixl_peer"}
        if backend in scripts:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            module = __import__(scripts[backend])
            return module.main(rest)
        if backend != "file":
            raise SystemExit(f"--backend must be file, {', '.join(scripts)}, got {backend!r}")
        argv = rest
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=256, help="pages written and read per repetition (default 256)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeat", type=int, default=3, help="repetitions (best and median reported)")
    p.add_argument("--dir", type=Path, help="a fresh folder is made (and removed) under it (default: system temp)")
    p.add_argument("--host-layout", default="page_first", choices=["page_first", "layer_first"])
    p.add_argument("--fsync", default="always", choices=["always", "never"], help="tier policy; raw fsyncs likewise")
    p.add_argument("--tenant-key", default="", help="authenticate pages with this key (a MAC per page)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.pages < 1 or args.repeat < 1:
        raise SystemExit("--pages and --repeat must be >= 1")

    torch.set_num_threads(1)
    pressure_start = cpu_pressure()
    omp = os.environ["OMP_WAIT_POLICY"]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_WAIT_POLICY={omp}")
    print(f"cpu pressure at start: {pressure_start}")
    root = Path(tempfile.mkdtemp(prefix="hicache-storage-", dir=args.dir))
    t0 = time.perf_counter()
    try:
        times, meta = anyio.run(measure, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    rows = summarize(times, meta["op_bytes"])

    print(
        f"\nfile tier, {meta['pages']} pages x {meta['page_bytes'] / 2**20:.2f} MiB ({meta['op_bytes'] / 1e9:.2f} GB), "
        f"host {args.host_layout}, fsync {args.fsync}, {meta['mac']}, best of {args.repeat}, under {root.parent}"
    )
    headers = ["op", "raw GB/s (best/median)", "hicache GB/s (best/median)", "ratio best / median"]
    body = [
        [
            op, f"{r['raw_best']:.2f} / {r['raw_median']:.2f}", f"{r['hicache_best']:.2f} / {r['hicache_median']:.2f}",
            f"{r['ratio_best']:.3f} / {r['ratio_median']:.3f}",
        ]
        for op, r in rows.items()
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    for cells in [headers, *body]:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    cpu = meta["cpu_seconds"]
    print("CPU seconds per GB (median; every thread of the process): " + ", ".join(
        f"{op} raw {statistics.median(cpu[op]['raw']) / meta['op_bytes'] * 1e9:.2f} / hicache "
        f"{statistics.median(cpu[op]['hicache']) / meta['op_bytes'] * 1e9:.2f}" for op in ("write", "read")))
    verdicts = (f"{op} {'yes' if r['ratio_median'] >= 0.8 else 'NO'}" for op, r in rows.items())
    print(f"\ntarget >= 0.8 x raw (medians): {', '.join(verdicts)}")
    print("backend stats: " + ", ".join(f"{k} {v}" for k, v in meta["backend_stats"].items()))
    pressure_end = cpu_pressure()
    print(f"\ncpu pressure at end: {pressure_end}")
    print(f"elapsed {elapsed:.1f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "cpu_pressure_start": pressure_start,
                    "cpu_pressure_end": pressure_end,
                    **meta,
                    "seconds": times,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
