"""Device <-> host page throughput of the io backends, as a ratio to a raw gather measured in the same run.

Usage::

    python benchmarks/transfer.py [--pages N] [--layers L] [--heads H] [--head-dim D] [--page-size 64]
                                  [--dtype float32] [--pool-factor 4] [--repeat R] [--threads 1]
                                  [--seed 0] [--json out.json]

For each io backend (``kernel``, ``direct``), host layout (``page_first``, ``layer_first``), direction and
destination allocation it times one transfer of ``--pages`` pages through ``TransferEngine``:

* ``backup``: ``device_to_host`` (all layers in one call);
* ``load``: ``host_to_device(layerwise=True)`` with a no-op ``on_layer`` callback.

Pools are ``--pool-factor`` times larger than the transfer; destination pages are what ``PageAllocator.allocate`` hands out, either on a fresh allocator
(one run of consecutive pages) or on a fragmented one (``frag``: allocate all, free a random half,
allocate). Source pages are one run (``node``: the pages of one cache node) or random (``scatter``,
``frag``).

The denominator is a raw ``torch.index_select(pool, 0, idx, out=buf)`` of the same bytes: a
contiguous pool of the same page size (the device buffer viewed as ``[pages, page_bytes]``), random
page indices, a contiguous ``out``. Each timed op runs back to back with one raw gather, so machine
noise hits both alike; ``ratio`` is the median over repeats of raw time / op time. A second
reference, ``chunk``, gathers the same bytes as random layer-chunks (one component of one layer of
one page, ``page_size * H * D`` elements, contiguous on both sides): with a layer-first device pool
no copy can move larger contiguous pieces, so ``/chunk`` says how close an op comes to what the
layout allows. All buffers are written before timing (no page faults), every configuration is
warmed up once, and that first copy is checked bit for bit against the source (after scribbling
over the destination pages).

GB = 1e9 bytes. Record /proc/pressure/cpu with the numbers: these machines are shared.
"""

from __future__ import annotations

import os

# Before torch is imported: idle OpenMP workers must not spin on a 2-vCPU machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hicache.io import DirectIOBackend, IOBackend, KernelIOBackend, TransferEngine  # noqa: E402
from hicache.tiers import DevicePool, HostPool, KVGeometry, MemoryTier, PageAllocator  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency, but the script should not need it
    tqdm = None

BACKENDS: dict[str, Callable[[], IOBackend]] = {"kernel": KernelIOBackend, "direct": DirectIOBackend}
LAYOUTS = ("page_first", "layer_first")
DIRECTIONS = ("backup", "load")  # device->host, host->device (layerwise)
# Which pages move: ``node`` = the pages of one cache node (allocated together: one run on both
# sides, the common case); ``scatter`` = random source pages into one destination run (a retrieve
# spanning many old nodes); ``frag`` = random source pages into a fragmented destination (a pool
# after heavy churn).
DST_KINDS = ("node", "scatter", "frag")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Row:
    direction: str
    layout: str
    backend: str
    dst: str
    runs: int  # runs of consecutive destination pages
    bytes: int
    gbps: float  # median
    gbps_min: float
    gbps_max: float
    raw_gbps: float  # median of the interleaved whole-page raw gather
    ratio: float  # median over repeats of raw_time / op_time (each pair timed back to back)
    chunk_gbps: float  # median of the interleaved layer-chunk raw gather
    chunk_ratio: float
    ok: bool


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return "(unreadable)"


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory as an integer tensor, so comparisons are bit-exact (NaN patterns included)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Write every byte (faults the pages in) with random bits."""
    bits(t).random_(generator=gen)


def count_runs(pages: list[int]) -> int:
    return sum(1 for i, p in enumerate(pages) if i == 0 or p != pages[i - 1] + 1)


def dst_pages(num_pages: int, n: int, kind: str, rng: random.Random) -> list[int]:
    alloc = PageAllocator(num_pages)
    if kind == "frag":
        everything = alloc.allocate(num_pages)
        alloc.free(rng.sample(everything, num_pages // 2))
    return alloc.allocate(n)


def open_pool(pool: MemoryTier) -> None:
    anyio.run(pool.open)


def _noop(_layer: int) -> None:
    pass


def run_config(
    direction: str,
    layout: str,
    backend: str,
    dst: str,
    device_pool: DevicePool,
    host_pool: HostPool,
    n: int,
    repeat: int,
    rng: random.Random,
    raw_op: Callable[[], None],
    chunk_op: Callable[[], None],
) -> Row:
    """Check one configuration once (which also warms it up), then time it ``repeat`` times."""
    engine = TransferEngine(BACKENDS[backend](), device_pool, host_pool)
    src_pool, dst_pool = (device_pool, host_pool) if direction == "backup" else (host_pool, device_pool)
    if dst == "node":
        start = rng.randrange(src_pool.num_pages - n + 1)
        src_idx = list(range(start, start + n))
    else:
        src_idx = rng.sample(range(src_pool.num_pages), n)
    dst_idx = dst_pages(dst_pool.num_pages, n, dst, rng)

    def op() -> None:
        if direction == "backup":
            engine.device_to_host(src_idx, dst_idx)
        else:
            engine.host_to_device(src_idx, dst_idx, _noop, layerwise=True)

    # Correctness: scribble over the destination pages, copy, compare bits with the source pages.
    d_t = torch.tensor(dst_idx, dtype=torch.long)
    s_t = torch.tensor(src_idx, dtype=torch.long)
    dst_pool.page_major().index_fill_(0, d_t, 0)
    op()
    ok = torch.equal(
        bits(dst_pool.page_major().index_select(0, d_t)), bits(src_pool.page_major().index_select(0, s_t))
    )
    raw_op()
    chunk_op()

    op_s: list[float] = []
    raw_s: list[float] = []
    chunk_s: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        raw_op()
        t1 = time.perf_counter()
        op()
        t2 = time.perf_counter()
        chunk_op()
        t3 = time.perf_counter()
        raw_s.append(t1 - t0)
        op_s.append(t2 - t1)
        chunk_s.append(t3 - t2)
    op_bytes = n * device_pool.geometry.page_bytes
    gbps = [op_bytes / s / 1e9 for s in op_s]
    return Row(
        direction, layout, backend, dst, count_runs(dst_idx), op_bytes,
        statistics.median(gbps), min(gbps), max(gbps),
        statistics.median(op_bytes / s / 1e9 for s in raw_s),
        statistics.median(r / o for r, o in zip(raw_s, op_s)),
        statistics.median(op_bytes / s / 1e9 for s in chunk_s),
        statistics.median(c / o for c, o in zip(chunk_s, op_s)),
        ok,
    )


def measure(args: argparse.Namespace) -> tuple[list[Row], dict]:
    dtype = getattr(torch, args.dtype)
    g = KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, dtype)
    n = args.pages
    if n < 1 or args.repeat < 1:
        raise SystemExit("--pages and --repeat must be >= 1")
    pool_pages = args.pool_factor * n
    if pool_pages < 2 * n:
        raise SystemExit("--pool-factor must be >= 2 (the fragmented case frees half the pool)")
    capacity = pool_pages * g.page_bytes
    op_bytes = n * g.page_bytes
    gen = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)

    device_pool = DevicePool(g, capacity, device="cpu")
    open_pool(device_pool)
    fill_random(device_pool.buffer, gen)

    # Raw denominator: the device buffer viewed as a contiguous pool of whole pages.
    raw_pool = device_pool.buffer.view(pool_pages, -1)
    raw_out = torch.empty((n, raw_pool.shape[1]), dtype=dtype)
    fill_random(raw_out, gen)
    raw_idx = torch.tensor(rng.sample(range(pool_pages), n), dtype=torch.long)
    # Second reference, the ceiling the layer-first device layout allows: the same bytes as random
    # [page_size, H, D] chunks (one component of one layer of one page), contiguous on both sides.
    chunk_pool = device_pool.buffer.view(-1, g.page_elems)
    chunk_out = raw_out.view(-1, g.page_elems)
    chunk_idx = torch.tensor(rng.sample(range(chunk_pool.shape[0]), chunk_out.shape[0]), dtype=torch.long)

    def raw_op() -> None:
        torch.index_select(raw_pool, 0, raw_idx, out=raw_out)

    def chunk_op() -> None:
        torch.index_select(chunk_pool, 0, chunk_idx, out=chunk_out)

    configs = [
        (layout, direction, backend, dst)
        for layout in LAYOUTS  # outermost: one host pool alive at a time
        for direction in DIRECTIONS
        for backend in BACKENDS
        for dst in DST_KINDS
    ]
    rows: list[Row] = []
    bar = tqdm(total=len(configs), file=sys.stderr, unit="cfg", leave=False) if tqdm else None
    host_pool: HostPool | None = None
    for layout, direction, backend, dst in configs:
        if host_pool is None or host_pool.layout != layout:
            host_pool = None  # free the old buffer before allocating the next
            host_pool = HostPool(g, capacity, layout=layout, pin_memory=False)
            open_pool(host_pool)
            fill_random(host_pool.buffer, gen)
        if bar:
            bar.set_description(f"{direction} {layout} {backend} {dst}")
        rows.append(
            run_config(
                direction, layout, backend, dst, device_pool, host_pool, n, args.repeat, rng, raw_op, chunk_op
            )
        )
        if bar:
            bar.update()
    if bar:
        bar.close()
    meta = {
        "geometry": {
            "components": g.components, "layers": g.num_layers, "page_size": g.page_size,
            "heads": g.num_kv_heads, "head_dim": g.head_dim, "dtype": args.dtype,
        },
        "page_bytes": g.page_bytes,
        "layer_page_bytes": g.components * g.page_elems * dtype.itemsize,
        "chunk_bytes": g.page_elems * dtype.itemsize,
        "pages": n,
        "pool_pages": pool_pages,
        "op_bytes": op_bytes,
    }
    return rows, meta


def print_table(rows: list[Row]) -> None:
    headers = [
        "direction", "layout", "backend", "dst", "runs", "GB/s", "min-max", "raw GB/s", "ratio", "chunk GB/s",
        "/chunk", "ok",
    ]
    body = [
        [
            r.direction, r.layout, r.backend, r.dst, str(r.runs),
            f"{r.gbps:.2f}", f"{r.gbps_min:.2f}-{r.gbps_max:.2f}", f"{r.raw_gbps:.2f}", f"{r.ratio:.3f}",
            f"{r.chunk_gbps:.2f}", f"{r.chunk_ratio:.3f}", "yes" if r.ok else "NO",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    right = set(range(4, 11))

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(fmt(headers))
    print("  ".join("-" * w for w in widths))
    for b in body:
        print(fmt(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64, help="pages per transfer (default 64)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=4, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pool-factor", type=int, default=4, help="pool pages = factor * pages (>= 2)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per configuration (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    pressure_start = cpu_pressure()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    )
    print(f"cpu pressure at start: {pressure_start}")
    t0 = time.perf_counter()
    rows, meta = measure(args)
    elapsed = time.perf_counter() - t0
    g = meta["geometry"]
    print(
        f"geometry: 2 x {g['layers']} layers x {g['page_size']} tokens x {g['heads']} heads x {g['head_dim']} "
        f"{g['dtype']}: page {meta['page_bytes'] / 2**20:.2f} MiB, "
        f"layer-chunk {meta['chunk_bytes'] / 2**10:.0f} KiB\n"
        f"{meta['pages']} pages ({meta['op_bytes'] / 2**20:.0f} MiB) per op, pools of {meta['pool_pages']} pages; "
        f"median of {args.repeat}; GB = 1e9 B\n"
        "backup = device_to_host (all layers per call); load = host_to_device(layerwise=True)\n"
        "raw    = index_select(pool, 0, idx, out=buf) of the same bytes in whole pages, timed back to back\n"
        "         with each op; ratio = median over repeats of raw time / op time\n"
        f"chunk  = the same gather in {meta['chunk_bytes'] / 2**10:.0f} KiB layer-chunks (the largest contiguous "
        "piece\n         of a layer-first device pool); /chunk = chunk time / op time\n"
    )
    print_table(rows)
    kernel = [r for r in rows if r.backend == "kernel"]
    if kernel:
        met = sum(r.ratio >= 0.9 for r in kernel)
        print(f"\nkernel >= 0.9 x raw in {met}/{len(kernel)} cases (worst {min(r.ratio for r in kernel):.3f})")
    if not all(r.ok for r in rows):
        print("\nBROKEN COPIES: rows with ok = NO did not copy the source pages", file=sys.stderr)
    pressure_end = cpu_pressure()
    print(f"\ncpu pressure at end: {pressure_end}")
    print(f"elapsed {elapsed:.1f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "cpu_pressure_start": pressure_start,
                    "cpu_pressure_end": pressure_end,
                    "repeat": args.repeat,
                    **meta,
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
