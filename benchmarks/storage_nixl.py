"""``kind: nixl`` (NIXL's POSIX plugin) against ``kind: file`` and the raw operation, in the same run.

Usage (``python benchmarks/storage.py --backend nixl ...`` runs this)::

    python benchmarks/storage_nixl.py [--pages 256] [--layers 30] [--heads 3] [--head-dim 64] [--page-size 64]
                                      [--repeat 3] [--fsync always|never] [--io auto,aio] [--write-threads 8] [--dir DIR]

The same tier path as ``benchmarks/storage.py`` (``StorageTier.store`` / ``fetch`` of ``--pages``
pages of random KV from and into a ``page_first`` host pool, headers and xxh3 checksums encoded and
verified), once over ``FileBackend`` and once over ``NixlFileBackend`` for each ``--io`` engine,
each in its own emptied folder, against the same raw denominators (one file written sequentially
with ``os.write`` and one fsync, read back cold with ``os.readv``). Every repetition runs raw write,
each tier's write, raw cold read, each tier's cold read, so machine noise hits all of them; "cold"
drops each file's page cache first (``fsync`` + ``POSIX_FADV_DONTNEED``). Every fetched page is
checked bit for bit, and no backend may count an error or a corrupt page. GB = 1e9 B; the table
gives the median and best GB/s, the ratio to raw of the medians, and the process's CPU seconds per GB.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import hicache  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent / "src"))

from storage_common import cpu_pressure, fsync, raw_read, raw_write  # noqa: E402

from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.file import FileBackend  # noqa: E402
from hicache.tiers.storage.nixl.agent import nixl_available  # noqa: E402
from hicache.tiers.storage.nixl.posix import NixlFileBackend  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402

Times = dict[str, dict[str, list[float]]]


async def measure(args: argparse.Namespace, root: Path) -> tuple[Times, Times, int]:
    g = KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, torch.float32)
    n = args.pages
    host = HostPool(g, n * g.page_bytes, layout="page_first", pin_memory=False)
    await host.open()
    host.buffer.view(-1).uniform_()
    saved = host.page_major().clone(memory_format=torch.contiguous_format)
    saved_bytes = saved.view(torch.uint8).view(n, -1).numpy()
    host_bytes = host.buffer.view(torch.uint8).view(n, -1).numpy()
    raw_header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    raw_file = root / "raw.bin"
    capacity = max(64 * 2**30, 2 * n * (HEADER_BYTES + g.page_bytes))
    backends = {"file": FileBackend(path=str(root / "file"), capacity=capacity, fsync=args.fsync)}
    for io in args.io:
        for threads in args.write_threads:
            backends[f"nixl ({io}, w{threads})"] = NixlFileBackend(
                path=str(root / f"nixl-{io}-{threads}"), capacity=capacity, fsync=args.fsync, io=io,
                write_threads=threads,
            )
    codec = PageCodec(namespace=b"\x01" * 16, geometry=g)
    batch = max(1, (64 * 2**20) // g.page_bytes)
    times: Times = {op: {"raw": [], **{k: [] for k in backends}} for op in ("write", "read")}
    cpu: Times = {op: {"raw": [], **{k: [] for k in backends}} for op in ("write", "read")}  # process CPU seconds
    pages = list(range(n))
    tiers = {name: StorageTier(name, b, codec, host, batch_pages=batch) for name, b in backends.items()}
    for tier in tiers.values():
        await tier.__aenter__()
    try:
        for _ in range(args.repeat):
            raw_file.unlink(missing_ok=True)
            for b in backends.values():
                await b.clear()
            fsync(root)
            keys = [os.urandom(16) for _ in range(n)]
            c0 = time.process_time()
            times["write"]["raw"].append(raw_write(raw_file, raw_header, saved_bytes, args.fsync == "always"))
            cpu["write"]["raw"].append(time.process_time() - c0)
            for name, tier in tiers.items():
                t0, c0 = time.perf_counter(), time.process_time()
                assert await tier.store(keys, pages) == n, name
                times["write"][name].append(time.perf_counter() - t0)
                cpu["write"][name].append(time.process_time() - c0)
            c0 = time.process_time()
            times["read"]["raw"].append(raw_read(raw_file, raw_header, host_bytes))
            cpu["read"]["raw"].append(time.process_time() - c0)
            assert np.array_equal(host_bytes, saved_bytes)
            for name, tier in tiers.items():
                host.buffer.zero_()
                backend = backends[name]
                assert isinstance(backend, FileBackend)
                for stored in codec.storage_keys(keys):
                    fsync(backend.path_of(stored), drop_cache=True)
                t0, c0 = time.perf_counter(), time.process_time()
                assert await tier.fetch(keys, pages) == n, name
                times["read"][name].append(time.perf_counter() - t0)
                cpu["read"][name].append(time.process_time() - c0)
                assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), f"{name}: pages differ"
    finally:
        for tier in tiers.values():
            await tier.__aexit__(None, None, None)
    for name, b in backends.items():
        s = b.stats()
        assert (s.errors, s.timeouts, s.corrupt_pages, tiers[name].failures) == (0, 0, 0, 0), (name, s)
    return times, cpu, n * (HEADER_BYTES + g.page_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fsync", default="always", choices=["always", "never"])
    p.add_argument("--io", default="auto,aio", help="NIXL POSIX engines to run, comma-separated: auto,aio,uring,posix_aio")
    p.add_argument("--write-threads", default="8", help="NIXL backends' write_threads to run, comma-separated")
    p.add_argument("--dir", type=Path, help="a fresh folder is made (and removed) under it (default: system temp)")
    args = p.parse_args(argv)
    args.io = [s.strip() for s in args.io.split(",") if s.strip()]
    args.write_threads = [int(s) for s in args.write_threads.split(",") if s.strip()]
    why = nixl_available()
    if why is not None:
        raise SystemExit(why)
    torch.set_num_threads(1)
    print(f"cpu pressure at start: {cpu_pressure()}")
    root = Path(tempfile.mkdtemp(prefix="hicache-nixl-", dir=args.dir))
    started = time.perf_counter()
    try:
        times, cpu, op_bytes = anyio.run(measure, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    page_mib = (op_bytes / args.pages - HEADER_BYTES) / 2**20
    print(f"\n{args.pages} pages x {page_mib:.2f} MiB ({op_bytes / 1e9:.2f} GB), fsync {args.fsync}, "
          f"{args.repeat} repetitions, under {root.parent}")
    print(f"{'op':<6}{'path':<22}{'median GB/s':>12}{'best GB/s':>11}{'x raw (median)':>16}{'CPU s/GB':>10}")
    for op, by_path in times.items():
        raw_median = statistics.median(op_bytes / s / 1e9 for s in by_path["raw"])
        for path, secs in by_path.items():
            gbps = [op_bytes / s / 1e9 for s in secs]
            median = statistics.median(gbps)
            cpu_gb = statistics.median(cpu[op][path]) / (op_bytes / 1e9)
            print(f"{op:<6}{path:<22}{median:>12.2f}{max(gbps):>11.2f}{median / raw_median:>16.2f}{cpu_gb:>10.2f}")
    print("(CPU: this process's user and system time, every thread, median)")
    print(f"\ncpu pressure at end: {cpu_pressure()}")
    print(f"elapsed {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
