"""The soak's traffic: clients holding multi-turn conversations over shared system prompts.

Each client turn is what an engine does for a request: ``lookup`` at enqueue, then ``retrieve``
(every layer read and compared, bit for bit, with the KV the prefix must have), then ``store`` of
the KV it "computed" after the cached prefix (``start=view.tokens``), inside the lease. Some calls
are cancelled at a random moment. The run is cut into phases: at the end of each, clients stop,
the cache settles and its invariants are checked, it is closed (draining what the write policy owes
storage), what it owed is looked for in storage, and a new cache over the same storage starts the
next phase, so conversations resumed later are served from storage. With ``faults``, servers the
soak started itself are killed and started again mid-phase.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import torch

from ..cache import HiCache
from ..config import HiCacheConfig
from ..containers import geometry_from_config
from ..errors import HiCacheError
from ..keys import as_token_bytes, chain_keys
from ..tiers.storage.registry import resolve_backend
from .invariants import consistency_problems
from .kv import PrefixKV
from .report import SoakReport
from .servers import ServerProcess

__all__ = ["SoakOptions", "run_soak"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakOptions:
    seconds: float
    clients: int = 4
    cancel_rate: float = 0.1
    phase_s: float = 20.0
    faults: bool = False
    seed: int = 0
    system_prompts: int = 3
    max_prompt_pages: int = 20


@dataclass
class Conversation:
    tokens: list[int]
    turns: int = 0


@dataclass
class Phase:
    """One cache's lifetime: what its clients stored (for the storage check afterwards)."""

    stored: list[list[int]] = field(default_factory=list)


class Soak:
    def __init__(self, config: HiCacheConfig, options: SoakOptions, servers: Sequence[ServerProcess]) -> None:
        self.config = config
        self.options = options
        self.servers = list(servers)
        self.geometry = geometry_from_config(config)
        self.kv = PrefixKV(self.geometry)
        self.page = config.page_size
        self.rng = random.Random(options.seed)
        self.report = SoakReport(clients=options.clients, page_bytes=self.geometry.page_bytes)
        self.systems = [
            [self.rng.randrange(1, 50_000) for _ in range(self.page * self.rng.randint(2, 4) + self.rng.randint(0, 7))]
            for _ in range(options.system_prompts)
        ]
        self.history: list[Conversation] = []  # conversations any client may resume

    # -- one client ------------------------------------------------------------------------------

    def _next_conversation(self, rng: random.Random) -> Conversation:
        if self.history and rng.random() < 0.3:
            return self.history.pop(rng.randrange(len(self.history)))
        return Conversation(list(rng.choice(self.systems)))

    async def _client(self, cid: int, cache: HiCache, stop: anyio.Event, phase: Phase) -> None:
        rng = random.Random(self.options.seed * 1000 + cid + 7919 * self.report.restarts)
        conv = self._next_conversation(rng)
        while not stop.is_set():
            if conv.turns >= rng.randint(3, 8) or len(conv.tokens) > self.options.max_prompt_pages * self.page:
                self.history.append(conv)
                conv = self._next_conversation(rng)
            prompt = conv.tokens + [rng.randrange(1, 50_000) for _ in range(rng.randint(8, 3 * self.page))]
            full = await self._turn(cache, rng, prompt, phase)
            if full is not None:
                conv.tokens = full
                conv.turns += 1

    async def _turn(self, cache: HiCache, rng: random.Random, prompt: list[int], phase: Phase) -> list[int] | None:
        """One request; the conversation's new tokens, or None if it was cancelled."""
        report = self.report
        t0 = time.perf_counter()
        hit = await cache.lookup(prompt)
        report.record("lookup", (time.perf_counter() - t0) * 1e3)
        report.prompt_tokens += len(prompt)
        cancel_after = rng.uniform(0, 0.005) if rng.random() < self.options.cancel_rate else None
        full = prompt + [rng.randrange(1, 50_000) for _ in range(4)]  # the "answer"
        stage = "retrieve"
        with anyio.move_on_after(cancel_after if cancel_after is not None else float("inf")):
            t0 = time.perf_counter()
            async with cache.retrieve(prompt) as view:
                n = view.tokens
                await self._check_layers(view, prompt)
                report.record("retrieve", (time.perf_counter() - t0) * 1e3)
                report.hit_tokens += n
                stage = "store"
                t0 = time.perf_counter()
                result = await cache.store(full, self.kv(full)[:, :, n:], start=n)
                report.record("store", (time.perf_counter() - t0) * 1e3)
                report.dropped_tokens += result.dropped_tokens
                phase.stored.append(full[: result.cached_tokens + result.stored_tokens])
                stage = "done"
        if stage != "done":
            report.cancelled[stage] += 1
            if hit.prefetch is not None:
                hit.prefetch.cancel()
            return None
        return full

    async def _check_layers(self, view: object, prompt: list[int]) -> None:
        n = view.tokens  # type: ignore[attr-defined]
        if n % self.page or n > len(prompt):
            self.report.violations.append(f"retrieve returned {n} tokens for a {len(prompt)}-token prompt")
            return
        if n == 0:
            return
        expected = self.kv(prompt[:n])
        for layer in range(self.geometry.num_layers):
            await view.wait_layer(layer)  # type: ignore[attr-defined]
            for c, part in enumerate(view.layer(layer)):  # type: ignore[attr-defined]
                if not torch.equal(part, expected[c, layer]):
                    self.report.wrong_kv += 1
                    log.error("soak: wrong KV in layer %d component %d of a %d-token prefix", layer, c, n)
                    return

    # -- phases ----------------------------------------------------------------------------------

    async def _faults(self, stop: anyio.Event, phase_s: float) -> None:
        if not (self.options.faults and self.servers):
            return
        server: ServerProcess | None = None
        with anyio.move_on_after(phase_s):
            await anyio.sleep(self.rng.uniform(0.2, 0.5) * phase_s)
            server = self.rng.choice(self.servers)
            name = server.argv[0].rsplit("/", 1)[-1]
            await anyio.to_thread.run_sync(server.kill)
            self.report.faults.append(f"{name} killed")
            await anyio.sleep(self.rng.uniform(0.5, 2.0))
        # Back even if the phase ended meanwhile, so the next one starts with it.
        if server is not None and server.proc is None:
            await anyio.to_thread.run_sync(server.start)
            self.report.faults[-1] += " and restarted"

    async def _phase(self, phase_s: float) -> None:
        phase = Phase()
        cache = HiCache.from_config(self.config)
        async with cache:
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                for cid in range(self.options.clients):
                    tg.start_soon(self._client, cid, cache, stop, phase)
                tg.start_soon(self._faults, stop, phase_s)
                await anyio.sleep(phase_s)
                stop.set()
            await cache.wait_idle()
            self.report.violations += consistency_problems(cache)
            seed = cache.controller.tree.seed
            storage = cache.controller.storage
            names = storage[0].codec.storage_keys if storage else list  # keyed names with a tenant key
        self._absorb(cache)
        self.report.restarts += 1
        await self._check_storage(seed, names, phase)

    def _absorb(self, cache: HiCache) -> None:
        stats = cache.stats()
        r = self.report
        r.bytes_moved.update(dict(stats.bytes_moved))
        r.lost_pages += stats.lost_pages
        r.short_retrieves += stats.short_retrieves
        r.short_retrieve_tokens += stats.short_retrieve_tokens
        r.eviction_waits += stats.eviction_waits
        r.storage_failures += sum(t.failures for t in stats.storage.values())

    async def _check_storage(self, seed: bytes, names: Callable[[list[bytes]], list[bytes]], phase: Phase) -> None:
        """Every page the write policy owed storage is there, asked of a fresh client per tier."""
        policy = self.config.policies.write
        if self.options.faults or policy == "write_through_selective" or not self.config.tiers.storage:
            return
        keys = names(sorted({k for tokens in phase.stored for k in chain_keys(seed, as_token_bytes(tokens), self.page)}))
        for entry in self.config.tiers.storage:
            options = dict(entry.options)
            if entry.kind == "mooncake":
                options["global_segment_size"] = 0  # a pure client: it takes no pages with it
            try:
                async with resolve_backend(entry.kind)(**options) as backend:
                    found = sum([await backend.exists([k]) for k in keys])
            except HiCacheError as exc:
                self.report.violations.append(f"storage tier {entry.tier_name} could not be checked: {exc}")
                continue
            self.report.owed_checked += len(keys)
            self.report.owed_found += found

    async def run(self) -> SoakReport:
        start = time.perf_counter()
        left = self.options.seconds
        while left > 0.5:
            await self._phase(min(self.options.phase_s, left))
            left = self.options.seconds - (time.perf_counter() - start)
        self.report.seconds = time.perf_counter() - start
        return self.report


async def run_soak(config: HiCacheConfig, options: SoakOptions, servers: Sequence[ServerProcess] = ()) -> SoakReport:
    return await Soak(config, options, servers).run()
