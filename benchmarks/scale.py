"""Per-call cost of the cache's bookkeeping as the pool and the index grow (10^3 .. 10^6 pages).

Usage::

    python benchmarks/scale.py [--sizes 1000,10000,100000,1000000] [--calls 100] [--memory-pages 100000]
                               [--prompt-pages 10] [--json out.json]

A tiny geometry (1 layer, 1 KV head, head_dim 2, float32, page 16: 256 bytes a page) makes data
copies negligible, so what is timed is bookkeeping: the index, the allocators and the evictor. For
each size N the device and the host tier hold N pages each, the index is filled with N/10 distinct
10-page prompts held on both tiers (inserted through ``Placement.insert_pages``: bookkeeping only), with the
``write_back`` and ``lru`` policies and watermark eviction off (``high_watermark: 1``) so that each
call does only its own work. All sizes stay open side by side and ``--calls`` cycles run, one
cycle per size in turn, so machine noise hits every size alike. A cycle times:

* ``lookup``: a cached 10-page prompt (``prefetch=False``);
* ``retrieve``: enter and leave ``retrieve`` of a cached, device-resident 10-page prompt;
* ``evict_device``: ``evict_device(10)`` on a full device (the victim has a host copy: no data moves);
* ``raw_copy``: the data copy a store makes, alone: ``anyio.to_thread.run_sync(engine.user_to_pool,
  ...)`` of 10 pages into pages set aside for it;
* ``store``: a new 10-page prompt into the free device pages the eviction left;
* ``store_full``: a new 10-page prompt into a full device: it evicts 10 pages first;
* ``evict_host`` (twice): ``evict_host(10)`` on a full host (a host-only leaf: no data moves); the
  room it makes becomes the host copy of the node just stored (untimed), so the next cycle finds
  the same state.

Each call is timed twice: wall time, and the CPU time of the event loop's thread
(``time.thread_time``), which is the bookkeeping's own cost whatever else the machine runs (the
copy runs on a worker thread and is not in it; what the loop spends to hand it over is, and
``raw_copy`` measures that). ``store_bookkeeping`` is each store minus the raw copy of its cycle.
Medians lead (these machines are shared and noisy); means follow in brackets.

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
from collections import deque  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from contextlib import AsyncExitStack  # noqa: E402
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
        inserted = ctl.placement.insert_pages(prompts.raw(i), 0, dev[i * pages : (i + 1) * pages], [])
        (node,) = inserted.nodes
        node.host = host[i * pages : (i + 1) * pages]
        if bar is not None and i % 1024 == 1023:
            bar.update(1024)
    if bar is not None:
        bar.close()


async def timed(samples: list[tuple[float, float]], call: Callable[[], Awaitable[object]]) -> object:
    """Await ``call()``; record its wall time and the CPU time of this (the event loop's) thread."""
    wall, cpu = time.perf_counter(), time.thread_time()
    out = await call()
    samples.append((time.perf_counter() - wall, time.thread_time() - cpu))
    return out


class Sized:
    """One cache of ``size`` pages, filled, and the cycle of calls timed on it.

    A cycle leaves the cache as it found it (device and host full, same number of prompts), so
    any number of cycles can run, interleaved across sizes: machine noise then hits every size
    alike. Per cycle: a lookup and a retrieve of a recent prompt (device-resident), an eviction
    of 10 device pages, the raw copy then a store into the freed pages, a store into the full
    device (it evicts 10 pages), and after each store an eviction of 10 host pages whose room
    becomes the new node's host copy (untimed: what a finished backup records).
    """

    def __init__(self, cache: HiCache, size: int, pages: int) -> None:
        self.cache = cache
        self.size = size
        self.pages = pages
        self.prompts = Prompts(pages)
        self.rng = random.Random(size)
        self.kv = torch.randn(2, 1, pages * PAGE_SIZE, 1, 2)
        self.raw_pages: list[int] = []
        self.count = 0
        self.recent: deque[int] = deque()

    async def setup(self) -> None:
        ctl = self.cache.controller
        pp = self.pages
        self.raw_pages = ctl.device.allocator.allocate(pp)  # the raw copy's own pages, outside the index
        ctl.host.allocator.allocate(pp)  # host as full as the device
        self.count = (ctl.device.num_pages - pp) // pp
        fill(self.cache, self.prompts, self.count, pp, progress=f"fill {self.size:,} pages")
        # The fill bypassed the calls that keep eviction's bookkeeping current (each store's
        # allocation does, for what it changed): catch up here, outside the timing.
        await ctl.evictor.evict_device(0)
        # Lookups and retrieves pick among the newest quarter: device-resident under LRU.
        self.recent = deque(range(self.count - max(1, self.count // 4), self.count), maxlen=max(1, self.count // 4))

    def _host_copy(self, i: int) -> None:
        """Record a host copy of prompt ``i``'s new node, in room an eviction just made (untimed)."""
        ctl = self.cache.controller
        (node,) = ctl.tree.match(self.prompts.raw(i)).path
        node.host = ctl.host.allocator.allocate(self.pages)

    async def cycle(self, results: dict[str, list[tuple[float, float]]]) -> None:
        cache, ctl, pp, kv = self.cache, self.cache.controller, self.pages, self.kv
        ids = self.prompts.ids(self.rng.choice(self.recent))
        hit = await timed(results["lookup"], lambda: cache.lookup(ids, prefetch=False))
        assert hit.tokens == len(ids)

        async def retrieve() -> None:
            async with cache.retrieve(self.prompts.ids(self.rng.choice(self.recent))) as view:
                assert view.tokens == pp * PAGE_SIZE and view.by_tier["device"] == view.tokens

        await timed(results["retrieve"], retrieve)
        assert await timed(results["evict_device"], lambda: ctl.evictor.evict_device(pp)) == pp
        await timed(
            results["raw_copy"],
            lambda: anyio.to_thread.run_sync(ctl.engine.user_to_pool, kv, 0, ctl.device, self.raw_pages, limiter=ctl.limiter),
        )
        for op in ("store", "store_full"):
            new = self.count
            self.count += 1
            ids = self.prompts.ids(new)
            stored = await timed(results[op], lambda ids=ids: cache.store(ids, kv))
            assert stored.stored_tokens == len(ids) and ctl.device.free_pages == 0
            assert await timed(results["evict_host"], lambda: ctl.evictor.evict_host(pp)) == pp
            self._host_copy(new)
            self.recent.append(new)


async def measure(sizes: list[int], args: argparse.Namespace) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """Fill one cache per size, then run ``--calls`` cycles, one per size in turn."""
    results: dict[int, dict[str, list[tuple[float, float]]]] = {size: {op: [] for op in OPS} for size in sizes}
    async with AsyncExitStack() as stack:
        benches = []
        for size in sizes:
            cache = await stack.enter_async_context(HiCache.from_config(make_config(size)))
            bench = Sized(cache, size, args.prompt_pages)
            await bench.setup()
            benches.append(bench)
        gc.collect()
        bar = tqdm(total=args.calls, desc="cycles", file=sys.stderr, leave=False) if tqdm else None
        for _ in range(args.calls):
            for bench in benches:
                await bench.cycle(results[bench.size])
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        for bench in benches:
            assert bench.cache.controller.counters.dropped_pages == 0
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


def summarize(samples: list[tuple[float, float]]) -> dict[str, float]:
    wall = [w for w, _ in samples]
    cpu = [c for _, c in samples]
    return {
        "calls": len(samples),
        "cpu_median_ms": statistics.median(cpu) * 1e3,
        "cpu_mean_ms": statistics.fmean(cpu) * 1e3,
        "wall_median_ms": statistics.median(wall) * 1e3,
        "wall_mean_ms": statistics.fmean(wall) * 1e3,
        "wall_max_ms": max(wall) * 1e3,
    }


def print_table(table: dict[int, dict[str, dict[str, float]]], sizes: list[int], ops: tuple[str, ...], what: str) -> None:
    print("| op | " + " | ".join(f"{s:,} pages" for s in sizes) + " | max / min |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for op in ops:
        medians = [table[s][op][f"{what}_median_ms"] for s in sizes]
        cells = [f"{table[s][op][f'{what}_median_ms']:.3f} ({table[s][op][f'{what}_mean_ms']:.3f})" for s in sizes]
        spread = max(medians) / min(medians) if min(medians) > 0 else math.inf
        print(f"| {op} | " + " | ".join(cells) + f" | {spread:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000", help="pool and index sizes, in pages")
    parser.add_argument("--calls", type=int, default=100, help="cycles (calls timed per operation and size)")
    parser.add_argument("--prompt-pages", type=int, default=10, help="pages per prompt (one node each)")
    parser.add_argument("--memory-pages", type=int, default=100_000, help="index size for the memory figure (0: skip)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)
    print(f"cpu pressure before: {cpu_pressure()}", flush=True)
    measured = anyio.run(measure, sizes, args)
    table: dict[int, dict[str, dict[str, float]]] = {}
    for size in sizes:
        results = measured[size]
        # Paired: each store minus the raw copy of the same cycle (wall and loop CPU alike).
        results["store_bookkeeping"] = [
            (sw - rw, sc - rc) for (sw, sc), (rw, rc) in zip(results["store"], results["raw_copy"], strict=True)
        ]
        table[size] = {op: summarize(samples) for op, samples in results.items()}
    memory = anyio.run(measure_memory, args.memory_pages, args) if args.memory_pages else None
    print(f"cpu pressure after: {cpu_pressure()}\n")
    ops = (*OPS, "store_bookkeeping")
    print("event-loop CPU per call, median ms (mean); the bookkeeping's own cost, whatever else runs")
    print_table(table, sizes, ops, "cpu")
    print("\nwall time per call, median ms (mean)")
    print_table(table, sizes, ops, "wall")
    if memory is not None:
        print(
            f"\nindex memory: {memory['bytes_per_page']:.0f} bytes per page "
            f"({memory['bytes'] / 2**20:.1f} MiB for {memory['pages']:,} pages of {args.prompt_pages}-page prompts, tracemalloc)"
        )
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "table": table, "memory": memory}, indent=2))


if __name__ == "__main__":
    main()
