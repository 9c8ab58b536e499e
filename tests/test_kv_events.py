"""KV events: a router's index built from them predicts every served hit exactly.

Real ZMQ sockets on loopback, a real file tier, the library's own cache. The trace is multi-turn
with tiers too small to hold it (56 pages): device 16 pages (one chat's longest prompt, 15, fits), host
24, the file tier 32 (it evicts), so hits come
from each tier and pages leave each tier while the trace runs.
"""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("zmq")

from hicache import HiCache  # noqa: E402
from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored, block_hash  # noqa: E402
from hicache.events.index import PrefixIndex  # noqa: E402
from hicache.events.subscriber import EventSubscriber  # noqa: E402
from hicache.events.wire import decode_batch, encode_batch  # noqa: E402

from .conftest import make_config, make_kv, make_tokens  # noqa: E402

PAGE = 4


def events_config(tmp_path, *, file_pages: int = 32, shared: list[str] | None = None, **over):
    base = make_config(16, 24)
    storage = [{"kind": "file", "name": "disk", "path": str(tmp_path / "pages"),
                "capacity": file_pages * base.page_bytes + 1}]
    return make_config(
        16, 24,
        tiers={"storage": storage},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 0, "write": "write_through"},
        kv_events={"enabled": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                   "shared_tiers": shared},
        **over,
    )


class Router:
    """One instance's subscriber feeding an index, as a router holds one per worker."""

    def __init__(self, cache: HiCache, name: str = "a", index: PrefixIndex | None = None) -> None:
        pub = cache.events.sink
        self.index = index or PrefixIndex()
        self.name = name
        self.batches: list[list] = []

        def take(seq: int, events: list) -> None:
            self.batches.append(events)
            self.index.apply(name, events)

        self.publisher = pub
        self.sub = EventSubscriber(pub.bound_endpoint, replay_endpoint=pub.bound_replay_endpoint, on_batch=take)

    async def sync(self, cache: HiCache) -> None:
        await cache.wait_idle()
        seq = await anyio.to_thread.run_sync(self.publisher.flush)
        await anyio.to_thread.run_sync(self.sub.until, seq)

    def close(self) -> None:
        self.sub.close()


def test_wire_format_round_trips() -> None:
    events = [BlockStored([1, 2**64 - 1], None, list(range(8)), 4, "CPU"),
              BlockStored([3], 2, [9, 9, 9, 9], 4, "STORAGE", "REMOTE", "hicache:s"),
              BlockRemoved([1], "DISK"), AllBlocksCleared()]
    ts, back, rank = decode_batch(encode_batch(12.5, events, 3))
    assert (ts, rank) == (12.5, 3)
    assert back == events


def test_block_hash_is_not_the_page_key() -> None:
    key = bytes(range(16))
    h = block_hash(key)
    assert 0 <= h < 2**64 and h.to_bytes(8, "big") not in key and block_hash(key) == h
    assert block_hash(bytes(16)) != h


async def test_index_from_events_predicts_every_served_hit(tmp_path) -> None:
    cfg = events_config(tmp_path)
    chats = [make_tokens(2 * PAGE + 1, seed=s) for s in range(4)]
    predicted_by_tier: dict[str, int] = {}
    checked = 0
    async with HiCache.from_config(cfg) as cache:
        router = Router(cache)
        try:
            await router.sync(cache)
            assert isinstance(router.batches[0][0], AllBlocksCleared)  # a start announces a clean slate
            for turn in range(5):
                for c, step in ((c, step) for c in range(len(chats)) for step in range(2)):
                    chat = chats[c]  # two steps of a chat in a row: the second finds the first on the device
                    chat += make_tokens(PAGE + 1, seed=100 * turn + 10 * c + step)  # an answer and a question
                    await router.sync(cache)
                    predicted = router.index.hit(chat, "a")
                    lookup = await cache.lookup(chat, prefetch=False)
                    async with cache.retrieve(chat) as view:
                        await view.wait_all()
                        served = view.tokens
                        for tier, n in view.by_tier.items():
                            predicted_by_tier[tier] = predicted_by_tier.get(tier, 0) + n
                    assert predicted == served == lookup.tokens, (turn, c, predicted, served, lookup.tokens)
                    checked += 1
                    kv = make_kv(cache.config, len(chat), seed=c)
                    await cache.store(chat, kv)
            await router.sync(cache)
            stats = cache.stats()
        finally:
            router.close()
    assert checked == 40
    # every tier served hits, and pages left every tier while the trace ran
    assert predicted_by_tier.get("device", 0) > 0 and predicted_by_tier.get("host", 0) > 0
    assert predicted_by_tier.get("disk", 0) > 0, predicted_by_tier
    assert stats.storage["disk"].backend.evicted_pages > 0
    removed = {e.medium for batch in router.batches for e in batch if isinstance(e, BlockRemoved)}
    assert {"GPU", "CPU", "DISK"} <= removed
