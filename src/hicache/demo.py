"""A self-contained tour of the API: ``python -m hicache.demo [--config PATH]`` (``make run``).

Simulates a multi-turn chat with random KV tensors (no model): each turn's prompt is the whole
history plus a new message. The device pool is small, so early turns are evicted to the host pool
and come back from there, layer by layer, bit-exact. Then the cache is closed and a new one opened
on the same file tier, as after a restart: each conversation comes back from storage.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio
import torch

from . import HiCache, load_config
from .config import format_size

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "small.yaml"


def _kv(config, tokens: list[int]) -> torch.Tensor:
    """Deterministic stand-in KV: each position's values depend only on its token and position."""
    m = config.model
    ids = torch.tensor(tokens, dtype=torch.float64).view(1, 1, -1, 1, 1)
    pos = torch.arange(len(tokens), dtype=torch.float64).view(1, 1, -1, 1, 1)
    shape = (m.kv_components, m.num_layers, len(tokens), m.num_kv_heads, m.head_dim)
    base = torch.arange(shape[0] * shape[1], dtype=torch.float64).view(shape[0], shape[1], 1, 1, 1)
    return (ids * 1e-3 + pos * 1e-6 + base).expand(shape).to(m.torch_dtype).contiguous()


async def run(config_path: Path, turns: int, clients: int, turn_tokens: int, keep_storage: bool = False) -> None:
    config = load_config(config_path)
    if not keep_storage:
        await _clear_storage(config)
    print(f"hicache demo: config {config_path.name}: model {config.model.name} "
          f"({config.model.num_layers} layers, {config.model.num_kv_heads} KV heads x {config.model.head_dim}, "
          f"{config.model.dtype}), page {config.page_size} tokens = {format_size(config.page_bytes)}")
    gen = torch.Generator().manual_seed(0)
    histories: list[list[int]] = [[] for _ in range(clients)]
    async with HiCache.from_config(config) as cache:
        stats = cache.stats()
        print(f"tiers: device {stats.tiers['device'].capacity_pages} pages, host {stats.tiers['host'].capacity_pages} pages; "
              f"write policy {config.policies.write}, eviction {config.policies.eviction}, io {config.io.backend}\n")
        print(f"{'turn':>4} {'client':>6} {'prompt':>7} {'cached':>7} {'device':>7} {'host':>6} {'verified':>9} {'ms':>7}")
        for turn in range(turns):
            for client in range(clients):
                history = histories[client]
                prompt = history + torch.randint(1, 32000, (turn_tokens,), generator=gen).tolist()
                start = time.perf_counter()
                hit = await cache.lookup(prompt)
                async with cache.retrieve(prompt) as view:
                    expected = _kv(config, prompt[: view.tokens])
                    ok = True
                    for layer in range(config.model.num_layers):
                        await view.wait_layer(layer)  # layer i is usable while later layers load
                        for c, part in enumerate(view.layer(layer)):
                            ok &= torch.equal(part, expected[c, layer])
                    by_tier = dict(view.by_tier)
                # The "engine" computed KV for the rest of the prompt; store the whole prompt.
                await cache.store(prompt, _kv(config, prompt))
                ms = (time.perf_counter() - start) * 1e3
                print(f"{turn:>4} {client:>6} {len(prompt):>7} {hit.tokens:>7} {by_tier['device']:>7} "
                      f"{by_tier['host']:>6} {'yes' if ok else 'NO':>9} {ms:>7.1f}")
                if not ok:
                    raise SystemExit("retrieved KV differs from what was stored")
                history.extend(prompt[len(history):])
        await cache.wait_idle()
        s = cache.stats()
    _print_stats(s)
    if config.tiers.storage:
        await restart(config, histories)


async def restart(config, histories: list[list[int]]) -> None:
    """A fresh cache (empty memory tiers) over the same storage: the history is found again."""
    print(f"\nrestart: a new cache, memory empty, storage {', '.join(t.tier_name for t in config.tiers.storage)} kept")
    async with HiCache.from_config(config) as cache:
        print(f"{'client':>6} {'prompt':>7} {'cached':>7} " + " ".join(f"{name:>7}" for name in cache.stats().storage)
              + f" {'verified':>9} {'ms':>7}")
        for client, history in enumerate(histories):
            start = time.perf_counter()
            hit = await cache.lookup(history)  # at enqueue: starts the prefetch from storage
            async with cache.retrieve(history) as view:
                await view.wait_all()
                expected = _kv(config, history[: view.tokens])
                ok = all(
                    torch.equal(part, expected[c, layer])
                    for layer in range(config.model.num_layers)
                    for c, part in enumerate(view.layer(layer))
                )
                by_tier = dict(view.by_tier)
            ms = (time.perf_counter() - start) * 1e3
            stored = " ".join(f"{by_tier[name]:>7}" for name in cache.stats().storage)
            print(f"{client:>6} {len(history):>7} {hit.tokens:>7} {stored} {'yes' if ok else 'NO':>9} {ms:>7.1f}")
            if not ok:
                raise SystemExit("KV read back from storage differs from what was stored")
        _print_stats(cache.stats())


def _print_stats(s) -> None:
    print("\nstats:")
    for name, tier in s.tiers.items():
        print(f"  {name:<6} used {tier.used_pages}/{tier.capacity_pages} pages, hits {tier.hit_tokens} tokens, "
              f"misses {tier.miss_tokens}, evicted {tier.evicted_pages} pages")
    moved = ", ".join(f"{k} {format_size(v) if v else 0}" for k, v in s.bytes_moved.items())
    print(f"  moved: {moved}")
    print(f"  stores {s.stores} ({s.stored_pages} pages), retrieves {s.retrieves}, backups {s.backups} pages, "
          f"loads {s.loads} pages, spills {s.spills}")
    for name, tier in s.storage.items():
        b = tier.backend
        print(f"  {name:<6} ({tier.kind}) {b.stored_pages} pages, {format_size(b.used_bytes or 0)} on disk; "
              f"wrote {tier.stored_pages} pages (skipped {tier.skipped_pages} it had), "
              f"prefetched {tier.fetched_pages}, served {tier.hit_tokens} tokens, failures {tier.failures}")


async def _clear_storage(config) -> None:
    """Start from empty storage tiers, so every run shows the same thing."""
    cache = HiCache.from_config(config)
    for tier in cache.controller.storage:
        async with tier.backend as backend:
            await backend.clear()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--keep-storage", action="store_true", help="do not empty the storage tiers first")
    args = parser.parse_args(argv)
    anyio.run(run, args.config, args.turns, args.clients, args.turn_tokens, args.keep_storage)


if __name__ == "__main__":
    main()
