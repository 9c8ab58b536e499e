"""A device spill that waits for host room: cancelled, it leaks nothing; raced, it copies the right pages.

The spill of a batch of victims reserves host pages one victim at a time; the room for a later one
may have to be made by writing a host page to storage first (write-back), which takes a while.
Meanwhile (both found by ``hicache soak`` with a storage server killed mid-run):

* the call may be cancelled (a request dropped mid-way): the victims already placed must get their
  pin, their ``backing_up`` flag and their host pages back;
* another call may split a placed victim (a prompt sharing its first pages): the copy must read
  the pages of the nodes that hold the victim's keys by then.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import torch

from hicache import HiCache
from hicache.keys import as_token_bytes
from hicache.tiers.storage.base import PageIO
from hicache.tiers.storage.memory import MemoryBackend

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent


async def test_a_spill_cancelled_while_waiting_for_host_room_leaks_nothing() -> None:
    config = make_config(
        4, 4,
        policies={"write": "write_back"},
        controller={"high_watermark": 1.0, "low_watermark": 0.5, "shutdown_timeout_s": 0.5},
        tiers={"storage": [{"kind": "tests.fakes:StallingStorageBackend", "timeout_s": 30}]},
    )
    a, b, c = (make_tokens(2 * config.page_size, seed=s) for s in (1, 2, 3))
    async with HiCache.from_config(config) as cache:
        ctl = cache.controller
        await cache.store(c, make_kv(config, len(c), seed=3))
        assert await ctl.evictor.evict_device(2) == 2  # c is spilled: host-only now, owed to storage
        assert ctl.host.used_pages == 2 and ctl.device.used_pages == 0
        await cache.store(a, make_kv(config, len(a), seed=1))
        await cache.store(b, make_kv(config, len(b), seed=2))
        # Spilling a and b: a finds host room, b needs c's room, and c must first reach storage,
        # which never answers. The caller gives up meanwhile.
        with anyio.move_on_after(0.3) as scope:
            await ctl.evictor.evict_device(4)
        assert scope.cancelled_caught
        assert ctl.host.used_pages == 2, "host pages reserved for the spill were not given back"
        assert_consistent(cache)
        hit = await cache.lookup(a, prefetch=False)
        assert hit.by_tier["device"] == len(a)  # a was not spilled: still on the device, evictable again


class GatedStorageBackend(MemoryBackend):
    """Fault fake: the in-memory backend, but every call waits until the test opens ``gate``."""

    kind = "gated"
    gate: anyio.Event | None = None

    async def _wait(self) -> None:
        if GatedStorageBackend.gate is not None:
            await GatedStorageBackend.gate.wait()

    async def _exists(self, keys: Sequence[bytes]) -> int:
        await self._wait()
        return await super()._exists(keys)

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        await self._wait()
        return await super()._set(keys, pages)


async def test_a_victim_split_while_its_spill_waits_is_copied_whole() -> None:
    """The spill copies the pages of the nodes holding the victim's keys when the copy starts."""
    config = make_config(
        4, 4,
        policies={"write": "write_back"},
        controller={"high_watermark": 1.0, "low_watermark": 0.5},
        tiers={"storage": [{"kind": "tests.test_spill_cancellation:GatedStorageBackend"}]},
    )
    ps = config.page_size
    a, b, c = (make_tokens(2 * ps, seed=s) for s in (1, 2, 3))
    kv_a = make_kv(config, len(a), seed=1)
    GatedStorageBackend.gate = anyio.Event()
    try:
        async with HiCache.from_config(config) as cache:
            ctl = cache.controller
            await cache.store(c, make_kv(config, len(c), seed=3))
            assert await ctl.evictor.evict_device(2) == 2  # c: host-only, owed to storage
            await cache.store(a, kv_a)
            await cache.store(b, make_kv(config, len(b), seed=2))
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctl.evictor.evict_device, 4)  # a placed; b waits for c's write
                await anyio.wait_all_tasks_blocked()
                (node_a,) = ctl.tree.match(as_token_bytes(a)).path
                assert node_a.backing_up  # a is being spilled
                # Another request shares a's first page only: a is split under the spill.
                ctl.tree.match(as_token_bytes(a[:ps] + make_tokens(ps, seed=9)), split=True)
                assert node_a.num_pages == 1
                GatedStorageBackend.gate.set()
            assert_consistent(cache)
            path = ctl.tree.match(as_token_bytes(a)).path
            assert [nd.num_pages for nd in path] == [1, 1] and all(nd.host is not None for nd in path)
            await ctl.evictor.evict_device(4)  # a now lives on the host only: its pages are its KV
            async with cache.retrieve(a) as view:
                await view.wait_all()
                assert view.tokens == len(a) and view.by_tier["host"] == len(a)
                k, v = view.layer(1)
                assert torch.equal(k, kv_a[0, 1]) and torch.equal(v, kv_a[1, 1])
    finally:
        GatedStorageBackend.gate = None
