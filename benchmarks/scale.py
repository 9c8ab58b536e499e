"""Per-call cost of the cache's bookkeeping as the pool and the index grow (10^3 .. 10^6 pages).

Usage::

    python benchmarks/scale.py [--sizes 1000,10000,100000,1000000] [--calls 100] [--memory-pages 100000]
                               [--prompt-pages 10] [--json out.json]

A tiny geometry (1 layer, 1 KV head, head_dim 2, float32, page 16: 256 bytes a page) makes data
copies negligible, so what is timed is bookkeeping: the index, the allocators and the evictor. For
each size N the device and the host tier hold N pages each, the index is filled with N/10 distinct
10-page prompts held on both tiers (inserted through ``insert_pages``: bookkeeping only), with the
``write_back`` and ``lru`` policies and watermark eviction off (``high_watermark: 1``) so that each
call does only its own work. Then, per call (mean and median, milliseconds):

* ``lookup``: a cached 10-page prompt (``prefetch=False``);
* ``retrieve``: enter and leave ``retrieve`` of a cached, device-resident 10-page prompt;
* ``evict_device``: ``evict_device(10)`` on a full device (victims have host copies: no data moves);
* ``store``: a new 10-page prompt into free device pages (those the evictions freed);
* ``store_full``: a new 10-page prompt into a full device: it evicts 10 pages first;
* ``evict_host``: ``evict_host(10)`` on a full host (host-only leaves: no data moves).

``store`` includes one data copy on a worker thread; ``raw_copy`` is that operation alone (the same
``anyio.to_thread.run_sync(engine.user_to_pool, ...)`` of the same 10 pages into pages set aside
for it), timed just before each store; ``store_bookkeeping`` is each store minus the raw copy
timed before it. Medians lead (these machines are shared and noisy); means follow in brackets. At
small sizes the whole sequence runs several times on fresh caches, so every figure is over about
``--calls`` calls (each phase uses at most a fifth of the prompts, so the pool's state stays the
one described).

Memory: the index's bytes per page, with ``tracemalloc``: what filling a cache of
``--memory-pages`` pages (and one eviction, so eviction structures are built) allocates, divided by
the pages indexed. It counts every structure that grows with the index: nodes, tokens, page keys,
page lists, the allocators' and the evictor's bookkeeping.

Target (issue 12): each figure flat within 1.5x from 10^3 to 10^6 pages, and at most 0.3 ms of
bookkeeping for a 10-page store. Record /proc/pressure/cpu with the numbers: these machines are
shared.
"""

from __future__ import annotations

import os

# Before torch is imported: idle OpenMP workers must not spin on a 2-vCPU machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from array import array  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hicache import HiCache, load_config  # noqa: E402
from hicache.config import HiCacheConfig  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency, but the script should not need it
    tqdm = None

PAGE_SIZE = 16
OPS = ("lookup", "retrieve", "evict_device", "store", "raw_copy", "store_full", "evict_host")


def make_config(pages: int) -> HiCacheConfig:
    base = {
        "model": {"name": "scale-bench", "num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "dtype": "float32"},
        "page_size": PAGE_SIZE,
        "policies": {"write": "write_back", "eviction": "lru"},
        "controller": {"high_watermark": 1.0, "low_watermark": 0.9},
        "tiers": {"device": {"device": "cpu"}, "host": {"pin_memory": False}},
    }
    page_bytes = load_config(overrides=base, env={}).page_bytes
    base["tiers"]["device"]["capacity"] = pages * page_bytes
    base["tiers"]["host"]["capacity"] = pages * page_bytes
    return load_config(overrides=base, env={})


class Prompts:
    """Distinct prompts of whole pages, made from their index (nothing kept per prompt)."""

    def __init__(self, pages: int) -> None:
        self.tokens = pages * PAGE_SIZE

    def ids(self, i: int) -> list[int]:
        return list(range(i * self.tokens, (i + 1) * self.tokens))

    def raw(self, i: int) -> bytes:
        return array("q", range(i * self.tokens, (i + 1) * self.tokens)).tobytes()


def fill(cache: HiCache, prompts: Prompts, count: int, pages: int, *, progress: str | None = None) -> None:
    """Index ``count`` prompts, each held on the device and the host (bookkeeping only, no copies)."""
    ctl = cache.controller
    dev = ctl.device.allocator.allocate(count * pages)
    host = ctl.host.allocator.allocate(count * pages)
    bar = tqdm(total=count, desc=progress, unit="prompt", file=sys.stderr, leave=False) if progress and tqdm else None
    for i in range(count):
        inserted = ctl.insert_pages(prompts.raw(i), 0, dev[i * pages : (i + 1) * pages], [])
        (node,) = inserted.nodes
        node.host = host[i * pages : (i + 1) * pages]
        if bar is not None and i % 1024 == 1023:
            bar.update(1024)
    if bar is not None:
        bar.close()


async def timed(samples: list[float], call: Callable[[], Awaitable[object]]) -> None:
    start = time.perf_counter()
    await call()
    samples.append(time.perf_counter() - start)


async def one_pass(size: int, args: argparse.Namespace, results: dict[str, list[float]]) -> None:
    """Fill a cache of ``size`` pages and time each operation (see the module docstring)."""
    config = make_config(size)
    pp = args.prompt_pages
    prompts = Prompts(pp)
    rng = random.Random(size)
    async with HiCache.from_config(config) as cache:
        ctl = cache.controller
        raw_pages = ctl.device.allocator.allocate(pp)  # the raw copy's own pages, outside the index
        count = (ctl.device.num_pages - pp) // pp
        fill(cache, prompts, count, pp, progress=f"fill {size:,} pages")
        # The fill bypassed the calls that keep eviction's bookkeeping current (each store's
        # allocation does, for what it changed): catch up here, outside the timing.
        await ctl.evictor.evict_device(0)
        k = max(1, min(args.calls, count // 5))
        kv = torch.randn(2, 1, pp * PAGE_SIZE, 1, 2)
        gc.collect()
        for _ in range(args.calls):
            ids = prompts.ids(rng.randrange(count))
            await timed(results["lookup"], lambda ids=ids: cache.lookup(ids, prefetch=False))
        for _ in range(args.calls):
            ids = prompts.ids(rng.randrange(count))

            async def retrieve(ids: list[int] = ids) -> None:
                async with cache.retrieve(ids) as view:
                    assert view.tokens == len(ids)

            await timed(results["retrieve"], retrieve)
        for _ in range(k):
            await timed(results["evict_device"], lambda: ctl.evictor.evict_device(pp))
        assert ctl.device.free_pages == k * pp, "evict_device freed an unexpected number of pages"
        next_id = count
        for _ in range(k):
            await timed(
                results["raw_copy"],
                lambda: anyio.to_thread.run_sync(
                    ctl.engine.user_to_pool, kv, 0, ctl.device, raw_pages, limiter=ctl.limiter
                ),
            )
            ids = prompts.ids(next_id)
            next_id += 1
            await timed(results["store"], lambda ids=ids: cache.store(ids, kv))
        assert ctl.device.free_pages == 0, "stores did not fill the freed pages"
        for _ in range(k):
            ids = prompts.ids(next_id)
            next_id += 1
            await timed(results["store_full"], lambda ids=ids: cache.store(ids, kv))
        assert ctl.counters.dropped_pages == 0
        for _ in range(k):
            await timed(results["evict_host"], lambda: ctl.evictor.evict_host(pp))
        ctl.device.allocator.free(raw_pages)


async def measure_size(size: int, args: argparse.Namespace) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {op: [] for op in OPS}
    while len(results["store"]) < args.calls:
        await one_pass(size, args, results)
    return results


async def measure_memory(pages: int, args: argparse.Namespace) -> dict[str, float]:
    """Bytes allocated per indexed page by filling a cache (and one eviction), with tracemalloc."""
    config = make_config(pages)
    pp = args.prompt_pages
    async with HiCache.from_config(config) as cache:
        count = cache.controller.device.num_pages // pp
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        fill(cache, Prompts(pp), count, pp, progress="memory")
        await cache.controller.evictor.evict_device(pp)  # builds whatever eviction keeps per node
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        indexed = count * pp
        return {"pages": indexed, "bytes": after - before, "bytes_per_page": (after - before) / indexed}


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().strip().splitlines()[0]
    except OSError:
        return "n/a"


def summarize(samples: list[float]) -> dict[str, float]:
    return {
        "calls": len(samples),
        "mean_ms": statistics.fmean(samples) * 1e3,
        "median_ms": statistics.median(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000", help="pool and index sizes, in pages")
    parser.add_argument("--calls", type=int, default=100, help="calls timed per operation and size")
    parser.add_argument("--prompt-pages", type=int, default=10, help="pages per prompt (one node each)")
    parser.add_argument("--memory-pages", type=int, default=100_000, help="index size for the memory figure (0: skip)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)
    print(f"cpu pressure before: {cpu_pressure()}", flush=True)
    table: dict[int, dict[str, dict[str, float]]] = {}
    ops = (*OPS, "store_bookkeeping")
    for size in sizes:
        results = anyio.run(measure_size, size, args)
        # Paired: each store minus the raw copy timed just before it.
        results["store_bookkeeping"] = [s - r for s, r in zip(results["store"], results["raw_copy"], strict=True)]
        table[size] = {op: summarize(s) for op, s in results.items()}
        row = table[size]
        print(f"{size:>9,} pages: " + "  ".join(f"{op} {row[op]['median_ms']:.3f}" for op in ops) + " (median ms)", flush=True)
    memory = anyio.run(measure_memory, args.memory_pages, args) if args.memory_pages else None
    print(f"cpu pressure after: {cpu_pressure()}\n")

    print("per call, median ms (mean in brackets); spread: largest / smallest median")
    print("| op | " + " | ".join(f"{s:,} pages" for s in sizes) + " | max / min |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for op in ops:
        medians = [table[s][op]["median_ms"] for s in sizes]
        cells = [f"{table[s][op]['median_ms']:.3f} ({table[s][op]['mean_ms']:.3f})" for s in sizes]
        spread = max(medians) / min(medians) if min(medians) > 0 else math.inf
        print(f"| {op} | " + " | ".join(cells) + f" | {spread:.2f}x |")
    if memory is not None:
        print(f"\nindex memory: {memory['bytes_per_page']:.0f} bytes per page ({memory['bytes'] / 2**20:.1f} MiB for {memory['pages']:,} pages, tracemalloc)")
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "table": table, "memory": memory}, indent=2))


if __name__ == "__main__":
    main()
