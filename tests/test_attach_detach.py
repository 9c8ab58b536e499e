"""Attaching and detaching storage tiers while the cache serves traffic, against the real backends.

Concurrent stores, lookups (which start prefetches) and retrieves run while tiers come and go; every
retrieve is checked bit for bit, no call may fail, and afterwards nothing leaked, nothing is left
``storing``, ``lost_pages == 0``, and the tier attached throughout holds every page write-through
promised it (asked of a fresh client).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from hicache import HiCache, HiCacheConfig, load_config
from hicache.errors import ConfigError, InvalidRequestError
from hicache.keys import as_token_bytes, chain_keys
from hicache.tiers.storage.registry import resolve_backend

from .helpers import assert_consistent

PAGE = 16
GEOMETRY = {"name": "attach-model", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
PAGE_BYTES = 2 * 3 * PAGE * 2 * 16 * 4
PROMPT_PAGES = 6
PROMPT_TOKENS = PROMPT_PAGES * PAGE + 5


def config(storage: list[dict[str, Any]], device_pages: int = 8, host_pages: int = 16, **policies: Any) -> HiCacheConfig:
    tiers: dict[str, Any] = {"device": {"capacity": device_pages * PAGE_BYTES}, "host": {"capacity": host_pages * PAGE_BYTES},
                             "storage": storage}
    return load_config(
        overrides={"model": GEOMETRY, "page_size": PAGE, "tiers": tiers,
                   "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0,
                                **policies},
                   "controller": {"shutdown_timeout_s": 60}},
        env={},
    )


def kv_of(seed: int) -> torch.Tensor:
    return torch.randn((2, 3, PROMPT_TOKENS, 2, 16), generator=torch.Generator().manual_seed(seed))


def tokens_of(seed: int) -> list[int]:
    return torch.randint(0, 50_000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()


async def count_in(entry: dict[str, Any], keys: list[bytes]) -> int:
    """How many of ``keys`` the tier holds, asked through a fresh client of the same store."""
    options = {k: v for k, v in entry.items() if k not in ("name", "kind")}
    if entry["kind"] == "mooncake":
        options["global_segment_size"] = 0
    async with resolve_backend(entry["kind"])(**options) as backend:
        return sum([await backend.exists([k]) for k in keys])


def file_entry(tmp_path: Path, name: str = "disk") -> dict[str, Any]:
    return {"kind": "file", "name": name, "path": str(tmp_path / name), "fsync": "never"}


class Traffic:
    """Stores, lookups and retrieves of known prompts, all checked; any error fails the test."""

    def __init__(self, cache: HiCache, prompts: int) -> None:
        self.cache = cache
        self.work = [(tokens_of(i), kv_of(i)) for i in range(prompts)]
        self.stored: list[int] = []
        self.retrieved_tokens = 0
        self.short = 0

    async def writer(self, first: int, step: int) -> None:
        for i in range(first, len(self.work), step):
            tokens, kv = self.work[i]
            result = await self.cache.store(tokens, kv)
            assert result.dropped_tokens == 0
            self.stored.append(i)
            await anyio.sleep(0.005)

    async def reader(self, rounds: int, seed: int) -> None:
        """At least ``rounds`` retrieves, and on until every prompt is stored; mostly of prompts stored
        long enough ago to have left memory, so they come back from storage (a prefetch)."""
        gen = torch.Generator().manual_seed(seed)
        done = 0
        while done < rounds or len(self.stored) < len(self.work):
            if not self.stored:
                await anyio.sleep(0.01)
                continue
            done += 1
            await anyio.sleep(0)  # a retrieve served from memory may never suspend: let the writers run
            old = self.stored[:-8] if len(self.stored) > 8 and done % 4 else self.stored
            i = old[int(torch.randint(0, len(old), (1,), generator=gen))]
            tokens, kv = self.work[i]
            await self.cache.lookup(tokens)  # starts the prefetch of what only storage holds
            async with self.cache.retrieve(tokens) as view:
                n = view.tokens
                self.retrieved_tokens += n
                self.short += n < PROMPT_PAGES * PAGE
                for layer in range(3):
                    await view.wait_layer(layer)
                    for c, part in enumerate(view.layer(layer)):
                        assert torch.equal(part, kv[c, layer, :n]), "wrong KV served"


async def test_attach_and_detach_under_traffic_lose_nothing(tmp_path: Path, valkey, mooncake_holder) -> None:
    disk = file_entry(tmp_path)  # attached throughout
    redis = {"kind": "redis", "name": "valkey", "url": f"redis://127.0.0.1:{valkey.port}/0",
             "key_prefix": f"ad{uuid.uuid4().hex[:10]}", "timeout_s": 5.0}
    mooncake = {"kind": "mooncake", "name": "mooncake", **mooncake_holder,
                "key_prefix": f"ad{uuid.uuid4().hex[:10]}", "global_segment_size": 0, "timeout_s": 5.0}
    changes = []
    async with HiCache.from_config(config([disk], device_pages=24, host_pages=32)) as cache:
        traffic = Traffic(cache, prompts=24)

        async def operator() -> None:
            while len(traffic.stored) < 4:
                await anyio.sleep(0.005)
            changes.append(await cache.attach_storage(redis, position=0))
            while len(traffic.stored) < 9:
                await anyio.sleep(0.005)
            changes.append(await cache.attach_storage(mooncake))
            while len(traffic.stored) < 14:
                await anyio.sleep(0.005)
            changes.append(await cache.detach_storage("valkey", drain=True))
            while len(traffic.stored) < 19:
                await anyio.sleep(0.005)
            changes.append(await cache.detach_storage("mooncake", drain=False))

        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic.writer, 0, 2)
            tg.start_soon(traffic.writer, 1, 2)
            tg.start_soon(traffic.reader, 40, 1)
            tg.start_soon(traffic.reader, 40, 2)
            tg.start_soon(operator)
        await cache.wait_idle()
        assert_consistent(cache)
        assert [c.action for c in changes] == ["attached", "attached", "detached", "detached"]
        assert changes[0].chain == ("valkey", "disk") and changes[1].chain == ("valkey", "disk", "mooncake")
        assert changes[-1].chain == ("disk",)
        assert list(cache.stats().storage) == ["disk"] and [e.tier_name for e in cache.config.tiers.storage] == ["disk"]
        stats = cache.stats()
        assert stats.prefetched_pages > 0, "no retrieve came from storage: the traffic did not exercise prefetch"
        seed = cache.controller.tree.seed
    assert cache.stats().lost_pages == 0
    assert sorted(traffic.stored) == list(range(24))
    keys = [k for tokens, _ in traffic.work for k in chain_keys(seed, as_token_bytes(tokens), PAGE)]
    assert await count_in(disk, keys) == len(keys), "a page write-through promised the permanent tier is missing"

    # A fresh cache over the permanent tier alone serves every prompt bit-exact.
    async with HiCache.from_config(config([disk], device_pages=8, host_pages=16)) as fresh:
        for tokens, kv in traffic.work[::5]:
            async with fresh.retrieve(tokens) as view:
                assert view.tokens == PROMPT_PAGES * PAGE
                for layer in range(3):
                    await view.wait_layer(layer)
                    assert torch.equal(view.layer(layer)[0], kv[0, layer, : view.tokens])


async def test_detaching_the_last_tier_under_write_through_leaves_nothing_storing(tmp_path: Path) -> None:
    slow = {"kind": "tests.fakes:DelayingStorageBackend", "name": "slow", "inner": file_entry(tmp_path, "p") | {"name": None},
            "delay_s": 0.005, "per_page_s": 0.002}
    slow["inner"].pop("name")
    async with HiCache.from_config(config([slow], device_pages=24, host_pages=32)) as cache:
        traffic = Traffic(cache, prompts=16)
        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic.writer, 0, 1)
            tg.start_soon(traffic.reader, 20, 3)
            while len(traffic.stored) < 6:
                await anyio.sleep(0.005)
            change = await cache.detach_storage("slow", drain=False)
        assert change.chain == ()
        assert not cache.controller.residency.has_storage
        await cache.wait_idle()
        assert not [n for n in cache.controller.tree.nodes() if n.storing], "a node is still marked storing"
        assert_consistent(cache)
        # Memory keeps evicting, freely: nothing is owed to a tier that no longer exists.
        for i in range(16, 30):
            await cache.store(tokens_of(i), kv_of(i))
        await cache.wait_idle()
        assert cache.stats().tiers["host"].evicted_pages > 0
        assert_consistent(cache)
    assert cache.stats().lost_pages == 0


async def test_a_detached_tier_s_failed_writes_are_not_counted_lost(tmp_path: Path) -> None:
    """Writes fail on one tier; once it is detached, its failures are forgiven and the pages reach the
    tier that remains: nothing is counted lost for a tier that is gone."""
    disk = file_entry(tmp_path)
    failing = {"kind": "tests.fakes:FailingStorageBackend", "name": "down", "timeout_s": 1.0}
    async with HiCache.from_config(config([disk, failing], host_pages=64)) as cache:
        work = [(tokens_of(i), kv_of(i)) for i in range(6)]
        for tokens, kv in work:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        assert any(n.store_failed for n in cache.controller.tree.nodes())
        change = await cache.detach_storage("down")
        assert change.retried_pages > 0
        assert not any(n.store_failed for n in cache.controller.tree.nodes())
        for i in range(6, 12):  # more than memory holds: the forgiven pages are written on the way out
            work.append((tokens_of(i), kv_of(i)))
            await cache.store(*work[-1])
        seed = cache.controller.tree.seed
    assert cache.stats().lost_pages == 0
    keys = [k for tokens, _ in work for k in chain_keys(seed, as_token_bytes(tokens), PAGE)]
    assert await count_in(disk, keys) == len(keys)


async def test_a_tier_attached_to_a_cache_without_storage_receives_what_is_owed(tmp_path: Path) -> None:
    disk = file_entry(tmp_path)
    work = [(tokens_of(i), kv_of(i)) for i in range(8)]
    async with HiCache.from_config(config([], device_pages=16, host_pages=64)) as cache:
        for tokens, kv in work[:4]:
            await cache.store(tokens, kv)
        change = await cache.attach_storage(disk)
        assert change.position == 0 and change.chain == ("disk",)
        assert cache.stats().queue_depths["storage"] == 0
        for tokens, kv in work[4:]:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage["disk"].stored_pages >= 4 * PROMPT_PAGES  # written at once: write-through
        seed = cache.controller.tree.seed
    assert cache.stats().lost_pages == 0
    keys = [k for tokens, _ in work for k in chain_keys(seed, as_token_bytes(tokens), PAGE)]
    # The pages stored before the attach were still in memory, owed to storage: written at close.
    assert await count_in(disk, keys) == len(keys)


async def test_detach_with_a_prefetch_in_flight_gives_a_shorter_prefix_never_an_error(tmp_path: Path) -> None:
    inner = {"kind": "file", "path": str(tmp_path / "slowpages"), "fsync": "never"}
    slow = {"kind": "tests.fakes:DelayingStorageBackend", "name": "slow", "inner": inner, "delay_s": 0.05, "per_page_s": 0.05}
    work = [(tokens_of(i), kv_of(i)) for i in range(3)]
    async with HiCache.from_config(config([slow], device_pages=8, host_pages=32)) as cache:
        for tokens, kv in work:
            await cache.store(tokens, kv)
    cfg = config([slow], device_pages=8, host_pages=32)
    cfg = cfg.model_copy(update={"controller": cfg.controller.model_copy(update={"storage_batch_bytes": PAGE_BYTES})})
    async with HiCache.from_config(cfg) as cache:
        tokens, kv = work[0]
        hit = await cache.lookup(tokens)
        assert hit.tokens == PROMPT_PAGES * PAGE and hit.prefetch is not None
        results: list[int] = []

        async def request() -> None:
            async with cache.retrieve(tokens) as view:
                for layer in range(3):
                    await view.wait_layer(layer)
                    assert torch.equal(view.layer(layer)[1], kv[1, layer, : view.tokens])
                results.append(view.tokens)

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await anyio.sleep(0.12)  # a page or two in
            change = await cache.detach_storage("slow", drain=False)
        assert change.drained_prefetches == 1 and change.cancelled_prefetches == 1
        assert results and results[0] < PROMPT_PAGES * PAGE
        await cache.wait_idle()
        assert_consistent(cache)
        # The other prompts are simply misses now.
        assert (await cache.lookup(work[1][0])).tokens == 0
    assert cache.stats().lost_pages == 0


async def test_attach_is_validated_like_config_and_changes_nothing_when_refused(tmp_path: Path) -> None:
    disk = file_entry(tmp_path)
    (tmp_path / "afile").write_text("x")
    async with HiCache.from_config(config([disk])) as cache:
        with pytest.raises(ConfigError, match="taken"):
            await cache.attach_storage(file_entry(tmp_path))  # the same name
        with pytest.raises(ConfigError, match=r"attach_storage: path: .*is a file"):
            await cache.attach_storage({"kind": "file", "name": "other", "path": str(tmp_path / "afile")})
        with pytest.raises(ConfigError, match="fsync"):
            await cache.attach_storage({"kind": "file", "name": "other", "path": str(tmp_path / "o"), "fsync": "sometimes"})
        with pytest.raises(ConfigError, match="unknown storage backend"):
            await cache.attach_storage({"kind": "nosuchkind"})
        with pytest.raises(InvalidRequestError, match="position"):
            await cache.attach_storage(file_entry(tmp_path, "other"), position=5)
        with pytest.raises(InvalidRequestError, match="no storage tier named 'nope'"):
            await cache.detach_storage("nope")
        assert list(cache.stats().storage) == ["disk"] and len(cache.config.tiers.storage) == 1
    async with HiCache.from_config(config([], host_pages=0)) as no_host:
        with pytest.raises(ConfigError, match="host tier"):
            await no_host.attach_storage(file_entry(tmp_path, "x"))
