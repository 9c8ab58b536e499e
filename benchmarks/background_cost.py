"""What the cache's background work costs a prefill that runs beside it, and what fsync costs.

Usage::

    python benchmarks/background_cost.py [--model smollm2] [--pages 9] [--prompt 512] [--repeat 8]

A multi-turn request stores its new pages (about 9 pages of 16 tokens here), and the cache then
backs them up to the host and writes them to the file tier in the background, while the next
request's prefill computes. This measures that overlap directly, on the benchmark's model and page
geometry. Each repeat runs, back to back so machine noise hits all alike:

* ``alone``: one prefill forward of ``--prompt`` tokens, nothing else running;
* ``beside, fsync=always`` / ``beside, fsync=never``: ``store`` of ``--pages`` fresh pages into a
  cache with a file tier, then at once the same forward, the backup and the file writes running
  beside it (``yield_to_prefills`` off: the cache does not know a prefill runs);
* ``yielding, fsync=never``: the same, with the cache told (``ComputeGate.wait_no_prefill``): the
  background work waits for the prefill and runs after it;
* ``no forward, fsync=...``: ``store`` and ``wait_idle`` alone: how long the backup and the file
  writes of one store take, with and without fsync.

Reported: the forward's wall time as a median ratio to ``alone`` (paired by repeat), the process
CPU seconds each trial took (forward + background), and how long the background work took to
finish (``wait_idle``), with the file tier's write calls timed separately. GB = 1e9 bytes. Record
/proc/pressure/cpu with the figures: these machines are shared.
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

from hicache import HiCache, load_config  # noqa: E402
from hicache.bench.models import MODELS, load_model  # noqa: E402
from hicache.bench.profiling import cpu_pressure  # noqa: E402
from hicache.integrations.transformers import CachedCausalLM, ComputeGate, model_overrides  # noqa: E402

PAGE = 16


def config(model: object, folder: Path, fsync: str, pages: int, repeat: int) -> object:
    base = model_overrides(model) | {"page_size": PAGE}
    page_bytes = load_config(overrides=base, env={}).page_bytes
    room = (pages * (repeat + 2)) * page_bytes
    return load_config(overrides=base | {
        "tiers": {
            "device": {"capacity": room, "device": "cpu"},
            "host": {"capacity": room, "pin_memory": False},
            "storage": [{"kind": "file", "path": str(folder), "fsync": fsync, "capacity": 4 * room}],
        },
        "policies": {"write": "write_through"},
    }, env={})


async def main_async(args: argparse.Namespace) -> None:
    model = load_model(args.model)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (1, args.prompt), generator=gen)
    spec = CachedCausalLM(model, None).spec
    tokens_per_store = args.pages * PAGE

    def forward() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            model(input_ids=prompt, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0, time.process_time() - c0

    forward()  # warm-up
    results: dict[str, list[tuple[float, float, float]]] = {}  # name -> (forward wall, cpu, background done)
    with tempfile.TemporaryDirectory() as tmp:
        caches = {
            "beside, fsync=always": (config(model, Path(tmp) / "always", "always", args.pages, args.repeat), False),
            "beside, fsync=never": (config(model, Path(tmp) / "never", "never", args.pages, args.repeat), False),
            "yielding, fsync=never": (config(model, Path(tmp) / "yield", "never", args.pages, args.repeat), True),
        }
        async with HiCache.from_config(caches["beside, fsync=always"][0]) as always, \
                HiCache.from_config(caches["beside, fsync=never"][0]) as never, \
                HiCache.from_config(caches["yielding, fsync=never"][0]) as yielding:
            opened = {"beside, fsync=always": always, "beside, fsync=never": never, "yielding, fsync=never": yielding}
            gates = {}
            for name, cache in opened.items():
                lm = CachedCausalLM(model, cache, yield_to_prefills=caches[name][1])
                gates[name] = lm.gate
            for _rep in range(args.repeat):
                wall, cpu = await anyio.to_thread.run_sync(forward)
                results.setdefault("alone", []).append((wall, cpu, 0.0))
                for name, cache in opened.items():
                    ids = torch.randint(100, vocab, (tokens_per_store,), generator=gen).tolist()
                    kv = torch.randn(2, spec.num_layers, tokens_per_store, spec.num_kv_heads, spec.head_dim,
                                     generator=gen)
                    await cache.store(ids, kv)  # queues the backup, then the file writes
                    t0, c0 = time.perf_counter(), time.process_time()
                    async with gates[name].hold(ComputeGate.PREFILL):
                        wall, _ = await anyio.to_thread.run_sync(forward)
                    await cache.wait_idle()
                    done, cpu = time.perf_counter() - t0, time.process_time() - c0
                    results.setdefault(name, []).append((wall, cpu, done))
                for name in ("beside, fsync=always", "beside, fsync=never"):
                    cache = opened[name]
                    ids = torch.randint(100, vocab, (tokens_per_store,), generator=gen).tolist()
                    kv = torch.randn(2, spec.num_layers, tokens_per_store, spec.num_kv_heads, spec.head_dim,
                                     generator=gen)
                    t0, c0 = time.perf_counter(), time.process_time()
                    await cache.store(ids, kv)
                    await cache.wait_idle()
                    done, cpu = time.perf_counter() - t0, time.process_time() - c0
                    results.setdefault(name.replace("beside", "no forward"), []).append((0.0, cpu, done))
            stats = {name: cache.stats() for name, cache in opened.items()}
    alone = [w for w, _, _ in results["alone"]]
    print(f"model {args.model}: forward of {args.prompt} tokens; each store {args.pages} pages of {PAGE} tokens "
          f"({args.pages * stats['beside, fsync=never'].tiers['device'].page_bytes / 1e6:.1f} MB); "
          f"median of {args.repeat}; torch threads {torch.get_num_threads()}")
    print(f"{'trial':24} {'forward ms':>10} {'vs alone':>9} {'CPU ms':>8} {'all done ms':>12}")
    for name, rows in results.items():
        walls = [w for w, _, _ in rows]
        ratio = statistics.median(w / a for w, a in zip(walls, alone))
        if name.startswith("no forward"):
            print(f"{name:24} {'-':>10} {'-':>9} {statistics.median(c for _, c, _ in rows) * 1e3:8.1f} "
                  f"{statistics.median(d for _, _, d in rows) * 1e3:12.1f}")
            continue
        print(f"{name:24} {statistics.median(walls) * 1e3:10.1f} {ratio:9.3f} "
              f"{statistics.median(c for _, c, _ in rows) * 1e3:8.1f} "
              f"{statistics.median(d for _, _, d in rows) * 1e3 if name != 'alone' else 0:12.1f}")
    for name, s in stats.items():
        file = s.storage["file"]
        print(f"  {name}: {s.backups} pages backed up, {file.stored_pages} written to the file tier")
    print(f"cpu pressure at end: {cpu_pressure()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--pages", type=int, default=9, help="pages stored before each forward (default 9)")
    p.add_argument("--prompt", type=int, default=136, help="tokens of the forward (default 136: a turn's new tokens)")
    p.add_argument("--repeat", type=int, default=8)
    args = p.parse_args(argv)
    print(f"cpu pressure at start: {cpu_pressure()}")
    anyio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
