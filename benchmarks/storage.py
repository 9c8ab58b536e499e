"""File-tier write and cold-read throughput, as a ratio to the raw operation on the same bytes in the same run.

Usage (``--backend redis`` / ``mooncake`` / ``s3`` / ``redis-cluster`` / ``nixl`` / ``nixl-peer`` run
``storage_redis.py`` / ``storage_mooncake.py`` / ``storage_s3.py`` / ``storage_redis_cluster.py`` /
``storage_nixl.py`` / ``storage_nixl_peer.py``, the other tiers' benchmarks, with the other arguments)::

    python benchmarks/storage.py --codecs none,lossless,int8,aes-gcm [--backend file|redis|s3] ...  # the codec axis
    python benchmarks/storage.py [--backend file|redis|mooncake|s3|redis-cluster|nixl|nixl-peer] [--pages 256] [--layers 30] [--heads 3] [--head-dim 64] [--page-size 64]
                                 [--dtype float32] [--repeat 3] [--dir DIR] [--host-layout page_first|layer_first]
                                 [--fsync always|never] [--tenant-key KEY] [--warmup 1] [--json out.json]

Builds the real components (``HostPool``, ``FileBackend``, ``PageCodec``, ``StorageTier``; no cache,
no controller) and times, on ``--pages`` pages of random KV:

* ``write``: ``StorageTier.store`` of every page into an emptied directory: one file per page,
  each sealed (header and xxh3 checksum, or with ``--tenant-key`` an AES-256-GMAC tag) by the
  writer thread that writes it, written into an unnamed ``O_TMPFILE`` and linked into place
  (fsynced first under ``--fsync always``);
* ``read``: ``StorageTier.fetch`` of every page, cold, into a zeroed host pool, every header and
  checksum or MAC checked on the tier's codec threads as the pages land.

Two raw operations move the same bytes (``pages x (128-byte header + payload)``) the plain way, in
one thread, from and into the same pre-faulted memory:

* ``raw`` (the target's denominator): one file written sequentially with ``os.write`` (header,
  payload, header, ...) and one ``fsync`` at the end (none under ``--fsync never``), read back cold
  with ``os.readv``;
* ``raw files``: a file per page, as a minimal tier that finds pages by name must keep them:
  ``open`` + one ``writev`` + ``close`` (an ``fsync`` each under ``--fsync always``), read back cold
  with ``open`` + ``preadv`` + ``close``. No atomic rename, no checks, no read-ahead.

"Cold" means the page cache of every file was dropped first with ``fsync`` +
``posix_fadvise(DONTNEED)``, which needs no privileges. Every timed write starts with the file
system's dirty pages written back (``syncfs``, outside the clock), so no flush of an earlier
write runs beside it. The paths run back to back in each repetition, in an order that turns from
one repetition to the next, after ``--warmup`` untimed repetitions; the table gives the best and
the median GB/s of each path and the tier's ratios to the raw ones: of the bests, of the medians,
and the median of the ratios within each repetition ("paired", which drifts least when the load
on the machine changes). Target: >= 0.8 of ``raw``, medians. It also prints the CPU seconds per GB
of each path (every thread of the process; steadier than wall time on a shared machine) and how
many cores the process got at the start and the end (two threads' BLAKE3 work over one's): the
tier spreads its work (the copy into the page cache, the MAC) over the cores, the raw operations
use one, so on a machine whose other core is taken the wall ratio falls to the CPU ratio.
Free memory is touched before every timed path (``--touch-free-memory``, on by default): on a
virtual machine with free page reporting (``dmesg``: "Free page reporting enabled", as the
Firecracker guests this project runs on), free blocks of 8 MiB are handed back to the host about two
seconds after they are freed, and the next write into each of their 4 KiB pages takes a fault in
the host: a path that fills the page cache from such memory spends 3-4x the kernel time on the same
copy (measured here: a tier write of 0.76 GB 0.17 s or 0.5-0.75 s, the raw cold read 0.4 s or
0.8-1.0 s, by which path the allocator happened to give reported blocks). Writing and freeing an
operation's worth of anonymous memory just before each clock starts gives every path, raw ones
included, memory the host holds, so the ratios measure the paths and not the order they ran in.
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
from typing import Any  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # storage_common and the other storage benchmarks

from storage_common import cores_available, cpu_pressure, fsync, raw_read, raw_write  # noqa: E402

from hicache.keys import TenantKey  # noqa: E402
from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.file import FileBackend  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402


def settle(path: Path) -> None:
    """Write back every dirty page of ``path``'s file system (``syncfs``) before a timed write, so no
    flush of earlier writes runs beside it: each path's write starts from the same clean state."""
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def touch_free_memory(nbytes: int) -> None:
    """Write ``nbytes`` of fresh anonymous memory and free it: the free blocks the next allocations
    take are then backed by the host (see the module docstring: free page reporting)."""
    if nbytes > 0:
        buf = np.ones(nbytes, dtype=np.uint8)  # a fresh mmap: every page faulted in and written
        del buf  # munmap: back to the guest's free lists, where the host still holds it for a while


def raw_write_files(
    folder: Path, header: np.ndarray, pages: np.ndarray, sync: bool, cpu: list[float] | None = None
) -> float:
    """A file per page (what a minimal tier that finds pages by name must write): open, one
    ``writev`` of header + payload, close (fsync each under ``sync``), one thread; seconds."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    fsync(folder.parent)
    c0 = time.process_time()
    t0 = time.perf_counter()
    written = 0
    for i, page in enumerate(pages):
        fd = os.open(folder / f"{i}.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written += os.writev(fd, [header, page])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    assert written == len(pages) * (HEADER_BYTES + pages.shape[1]), "short raw write"
    return elapsed


def raw_read_files(folder: Path, header: np.ndarray, into: np.ndarray, cpu: list[float] | None = None) -> float:
    """Read the files of ``raw_write_files`` back cold, one ``preadv`` each, one thread; seconds."""
    names = [folder / f"{i}.kv" for i in range(len(into))]
    for name in names:
        fsync(name, drop_cache=True)
    c0 = time.process_time()
    t0 = time.perf_counter()
    got = 0
    for name, page in zip(names, into, strict=True):
        fd = os.open(name, os.O_RDONLY)
        try:
            got += os.preadv(fd, [header, page], 0)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
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
    paths = ("raw", "raw_files", "hicache")
    times: dict[str, dict[str, list[float]]] = {op: {path: [] for path in paths} for op in ("write", "read")}
    # CPU seconds of the whole process (every thread) per operation: steadier than wall time on a
    # shared machine, and what the tier costs beyond the raw operation.
    cpu: dict[str, dict[str, list[float]]] = {op: {path: [] for path in paths} for op in ("write", "read")}
    sync = args.fsync == "always"
    files = root / "raw-files"

    touch = int(n * (HEADER_BYTES + g.page_bytes) * 1.25) if args.touch_free_memory else 0

    async def timed(op: str, path: str, run: Any) -> None:
        touch_free_memory(touch)  # every path starts with host-backed free memory (outside its clock)
        if path != "hicache":  # the raw functions time themselves (their fsync-and-drop set-up stays outside)
            times[op][path].append(run(cpu[op][path]))
            return
        c0, t0 = time.process_time(), time.perf_counter()
        await run()
        times[op][path].append(time.perf_counter() - t0)
        cpu[op][path].append(time.process_time() - c0)

    async with tier:
        for rep in tqdm(range(args.warmup + args.repeat), desc="repetitions", file=sys.stderr, leave=False):
            # Fresh files for all, deletions made durable before the clocks start.
            raw_file.unlink(missing_ok=True)
            await backend.clear()
            fsync(root)
            keys = [os.urandom(16) for _ in range(n)]

            async def tier_write(keys: list[bytes] = keys) -> None:
                written = await tier.store(keys, host_pages)
                assert written == n, f"store wrote {written} of {n} pages"

            async def tier_read(keys: list[bytes] = keys) -> None:
                got = await tier.fetch(keys, host_pages)
                assert got == n, f"fetch verified {got} of {n} pages"

            # The order turns every repetition, so dirty pages and caches left by one path weigh on each.
            writes = [
                ("raw", lambda out: raw_write(raw_file, raw_header, saved_bytes, sync, out)),
                ("raw_files", lambda out: raw_write_files(files, raw_header, saved_bytes, sync, out)),
                ("hicache", tier_write),
            ]
            for path, run in writes[rep % 3 :] + writes[: rep % 3]:
                settle(root)
                await timed("write", path, run)

            def cold_tier(keys: list[bytes] = keys) -> None:
                host.buffer.zero_()
                for name in codec.storage_keys(keys):  # the files are named by the codec (keyed names with a key)
                    fsync(backend.path_of(name), drop_cache=True)

            reads = [
                ("raw", lambda out: raw_read(raw_file, raw_header, host_bytes, out)),
                ("raw_files", lambda out: raw_read_files(files, raw_header, host_bytes, out)),
                ("hicache", tier_read),
            ]
            for path, run in reads[rep % 3 :] + reads[: rep % 3]:
                if path == "hicache":
                    cold_tier()
                await timed("read", path, run)
                if path == "hicache":
                    assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), "fetched pages differ"
                else:
                    # torch.equal compares in place (np.array_equal would fault in a 0.4 GB temporary)
                    assert torch.equal(torch.from_numpy(host_bytes), torch.from_numpy(saved_bytes)), f"{path} read differs"
        for table in (times, cpu):  # the warm-up repetitions pay for first touches (threads, folders, memory)
            for by_path in table.values():
                for values in by_path.values():
                    del values[: args.warmup]
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
        "touch_free_memory": args.touch_free_memory,
        "mac": "aes-256-gmac (tenant_key)" if args.tenant_key else "xxh3-64 checksum (no key)",
        "cpu_seconds": cpu,
        "backend_stats": {
            "pages_written": stats.pages_written, "pages_read": stats.pages_read, "errors": stats.errors,
            "timeouts": stats.timeouts, "corrupt_pages": stats.corrupt_pages, "tier_failures": tier.failures,
        },
    }
    return times, meta


def summarize(times: dict[str, dict[str, list[float]]], op_bytes: int) -> dict[str, dict[str, float]]:
    """GB/s best and median per path; the tier's ratio to each raw path: of the bests, of the
    medians, and the median of the ratios within each repetition (the paths run back to back, so
    this one drifts least when the machine's load changes between repetitions)."""
    out: dict[str, dict[str, float]] = {}
    for op, by_path in times.items():
        row: dict[str, float] = {}
        for path, secs in by_path.items():
            gbps = [op_bytes / s / 1e9 for s in secs]
            row[f"{path}_best"], row[f"{path}_median"] = max(gbps), statistics.median(gbps)
        for raw, suffix in (("raw", ""), ("raw_files", "_files")):
            row[f"ratio{suffix}_best"] = row["hicache_best"] / row[f"{raw}_best"]
            row[f"ratio{suffix}_median"] = row["hicache_median"] / row[f"{raw}_median"]
            row[f"ratio{suffix}_paired"] = statistics.median(
                r / h for r, h in zip(by_path[raw], by_path["hicache"], strict=True)
            )
        out[op] = row
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The codec axis (bytes per page, logical GB/s per codec chain, for file, redis and s3) is
    # benchmarks/storage_codecs.py: `--codecs none,lossless,...` runs it with the other arguments.
    if any(a == "--codecs" or a.startswith("--codecs=") for a in argv):
        return __import__("storage_codecs").main(argv)
    # The shared tiers have their own scripts (a server to start, a raw client to compare with);
    # `--backend redis|mooncake|s3|redis-cluster|nixl|nixl-peer` runs them with the remaining arguments.
    # Each is imported only when asked for (each needs its own client library), by name, so
    # tests/test_architecture.py sees the arrow.
    if "--backend" in argv:
        i = argv.index("--backend")
        backend, rest = argv[i + 1] if i + 1 < len(argv) else "", argv[:i] + argv[i + 2 :]
        scripts = {
            "redis": lambda: __import__("storage_redis"), "mooncake": lambda: __import__("storage_mooncake"),
            "s3": lambda: __import__("storage_s3"), "redis-cluster": lambda: __import__("storage_redis_cluster"),
            "nixl": lambda: __import__("storage_nixl"), "nixl-peer": lambda: __import__("storage_nixl_peer"),
        }
        if backend in scripts:
            return scripts[backend]().main(rest)
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
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--dir", type=Path, help="a fresh folder is made (and removed) under it (default: system temp)")
    p.add_argument("--host-layout", default="page_first", choices=["page_first", "layer_first"])
    p.add_argument("--fsync", default="always", choices=["always", "never"], help="tier policy; raw fsyncs likewise")
    p.add_argument("--tenant-key", default="", help="authenticate pages with this key (a MAC per page)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--touch-free-memory", action=argparse.BooleanOptionalAction, default=True,
        help="write and free 1.25x an operation's bytes of memory before each timed path (default on; see above)",
    )
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
    cores_start = cores_available()
    try:
        times, meta = anyio.run(measure, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta["cores"] = [cores_start, cores_available()]
    elapsed = time.perf_counter() - t0
    rows = summarize(times, meta["op_bytes"])

    print(
        f"\nfile tier, {meta['pages']} pages x {meta['page_bytes'] / 2**20:.2f} MiB ({meta['op_bytes'] / 1e9:.2f} GB), "
        f"host {args.host_layout}, fsync {args.fsync}, {meta['mac']}, {args.repeat} repetitions, under {root.parent}, "
        f"free memory {'touched' if args.touch_free_memory else 'NOT touched'} before each path"
    )
    print("raw: one file, written sequentially / read back cold (the target's denominator); raw files: a file per "
          "page, open + writev / preadv + close, one thread (what a minimal tier that names pages must do)")
    headers = ["op", "raw GB/s (best/median)", "raw files GB/s", "hicache GB/s", "x raw (best/median/paired)",
               "x raw files (median/paired)"]
    body = [
        [
            op, f"{r['raw_best']:.2f} / {r['raw_median']:.2f}", f"{r['raw_files_best']:.2f} / {r['raw_files_median']:.2f}",
            f"{r['hicache_best']:.2f} / {r['hicache_median']:.2f}",
            f"{r['ratio_best']:.3f} / {r['ratio_median']:.3f} / {r['ratio_paired']:.3f}",
            f"{r['ratio_files_median']:.3f} / {r['ratio_files_paired']:.3f}",
        ]
        for op, r in rows.items()
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    for cells in [headers, *body]:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    cpu = meta["cpu_seconds"]
    per_gb = {op: {path: statistics.median(v) / meta["op_bytes"] * 1e9 for path, v in cpu[op].items()} for op in cpu}
    print("CPU seconds per GB (median, every thread of the process; x raw = raw CPU / hicache CPU): " + "; ".join(
        f"{op} raw {c['raw']:.3f} / raw files {c['raw_files']:.3f} / hicache {c['hicache']:.3f} "
        f"(x raw {c['raw'] / c['hicache']:.2f})" for op, c in per_gb.items()))
    print(f"cores this process got (two threads' work over one's): {meta['cores'][0]:.2f} at start, "
          f"{meta['cores'][1]:.2f} at end")
    verdicts = (f"{op} {'yes' if r['ratio_median'] >= 0.8 else 'NO'} ({r['ratio_median']:.2f})" for op, r in rows.items())
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
