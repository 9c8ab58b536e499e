"""A device eviction cancelled while its spill waits for host room leaks nothing.

The spill of a batch of victims reserves host pages one victim at a time; the room for a later one
may have to be made by writing a host page to storage first (write-back). When the call is
cancelled there (a request dropped mid-way), the victims already placed must get their pin, their
``backing_up`` flag and their host pages back (found by ``hicache soak`` with a storage server
killed mid-run).
"""

from __future__ import annotations

import anyio

from hicache import HiCache

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
