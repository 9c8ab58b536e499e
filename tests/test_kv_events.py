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


async def test_shared_tier_blocks_are_a_hit_for_every_instance_that_reads_it(tmp_path) -> None:
    """Two instances on one folder, named shared: what A wrote is B's hit, announced once for the tier."""
    cfg = events_config(tmp_path, shared=["disk"], file_pages=200)
    index = PrefixIndex()
    tokens = make_tokens(6 * PAGE + 1, seed=7)
    async with HiCache.from_config(cfg) as a, HiCache.from_config(cfg) as b:
        ra, rb = Router(a, "a", index), Router(b, "b", index)
        try:
            await a.store(tokens, make_kv(a.config, len(tokens)))
            await ra.sync(a)
            await rb.sync(b)
            stored = [e for batch in ra.batches for e in batch if isinstance(e, BlockStored) and e.medium == "SHARED"]
            assert stored and all((e.locality, e.ownership) == (None, None) for e in stored)
            assert index.hit(tokens, "b") == 6 * PAGE  # B never stored it: the shared tier is its hit
            assert index.hit(tokens, "b", shared=False) == 0
            async with b.retrieve(tokens) as view:
                await view.wait_all()
                assert view.tokens == 6 * PAGE and view.by_tier["disk"] == 6 * PAGE
            # A leaving (its close clears what A announced) keeps the tier's blocks for B
        finally:
            ra.close()
    async with HiCache.from_config(cfg) as b2:  # noqa: F841 - the index outlives the instances
        pass
    assert index.hit(tokens, "b") == 6 * PAGE
    rb.close()


async def test_a_late_subscriber_catches_up_by_replay_and_removals_follow_loss(tmp_path) -> None:
    cfg = events_config(tmp_path)
    tokens = make_tokens(5 * PAGE + 1, seed=3)
    async with HiCache.from_config(cfg) as cache:
        await cache.store(tokens, make_kv(cache.config, len(tokens)))
        await cache.wait_idle()
        seq = await anyio.to_thread.run_sync(cache.events.sink.flush)
        assert seq >= 1
        router = Router(cache)  # joins after every batch went out: only the replay has them
        try:
            await router.sync(cache)
            assert router.sub.replayed == seq and router.sub.missed == 0
            assert router.index.hit(tokens, "a") == 5 * PAGE
            # a corrupt page in storage: the read finds it, the hit is shorter, and it is removed
            from .helpers import push_to_storage

            await push_to_storage(cache)
            await router.sync(cache)
            assert router.index.hit(tokens, "a") == 5 * PAGE  # storage only now
            files = sorted((tmp_path / "pages").rglob("*.kv"), key=lambda f: f.stat().st_mtime_ns)
            assert len(files) == 5
            victim = files[2]
            data = bytearray(victim.read_bytes())
            data[-1] ^= 0xFF
            victim.write_bytes(bytes(data))
            async with cache.retrieve(tokens) as view:
                await view.wait_all()
                served = view.tokens
            assert served < 5 * PAGE
            await router.sync(cache)
            assert router.index.hit(tokens, "a") == served
            # a detached tier: everything it was announced with is removed
            await cache.detach_storage("disk")
            await push_to_storage(cache)
            await router.sync(cache)
            assert router.index.hit(tokens, "a") == 0
        finally:
            router.close()


async def test_a_full_queue_drops_and_counts_then_announces_a_clean_slate(tmp_path) -> None:
    """The cache never waits for events: past the queue they are dropped, and the journal then
    re-announces what holds, so the index is right again."""
    cfg = events_config(tmp_path, file_pages=400)
    async with HiCache.from_config(cfg) as cache:
        pub = cache.events.sink
        router = Router(cache)
        try:
            await router.sync(cache)
            pub.max_queue_size = 3  # a burst is bigger than that
            chats = [make_tokens(4 * PAGE + 1, seed=20 + i) for i in range(6)]
            for chat in chats:
                await cache.store(chat, make_kv(cache.config, len(chat)))
            await cache.wait_idle()
            assert pub.dropped_events > 0
            pub.max_queue_size = 100_000
            extra = make_tokens(2 * PAGE, seed=99)  # the next event finds room: a clean slate first
            await cache.store(extra, make_kv(cache.config, len(extra)))
            await router.sync(cache)
            assert cache.events.resyncs >= 1
            for chat in chats + [extra]:
                lookup = await cache.lookup(chat, prefetch=False)
                assert router.index.hit(chat, "a") == lookup.tokens
        finally:
            router.close()


async def test_keyed_namespaces_publish_no_page_key_or_storage_name(tmp_path) -> None:
    cfg = events_config(tmp_path, tenant_key="k" * 32)
    payloads: list[bytes] = []
    tokens = make_tokens(4 * PAGE + 1, seed=5)
    async with HiCache.from_config(cfg) as cache:
        router = Router(cache)
        try:
            import zmq

            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(cache.events.sink.bound_endpoint)
            await anyio.sleep(0.2)
            await cache.store(tokens, make_kv(cache.config, len(tokens)))
            await router.sync(cache)
            while sub.poll(200):
                payloads.append(sub.recv_multipart()[2])
            sub.close(0)
            keys = [k for node in cache.controller.tree.nodes() for k in node.keys]
            names = cache.controller.storage[0].codec.storage_keys(keys)
        finally:
            router.close()
    blob = b"".join(payloads)
    assert payloads and len(keys) == 4
    for secret in list(keys) + list(names):
        for piece in (secret, secret[:8], secret[-8:], secret.hex().encode()):
            assert piece not in blob
    assert b"k" * 16 not in blob


async def test_pages_after_a_gap_are_withdrawn_and_announced_again_when_it_fills(tmp_path) -> None:
    """A hit is a prefix: pages in storage after a page no tier holds cannot be served, so they are
    removed from the index (their files stay) and come back when the gap is filled."""
    cfg = events_config(tmp_path, file_pages=200)
    tokens = make_tokens(3 * PAGE + 1, seed=11)
    async with HiCache.from_config(cfg) as cache:
        router = Router(cache)
        try:
            from .helpers import push_to_storage

            kv = make_kv(cache.config, len(tokens))
            await cache.store(tokens, kv)
            await push_to_storage(cache)
            await router.sync(cache)
            assert router.index.hit(tokens, "a") == 3 * PAGE
            tier = cache.controller.storage[0]
            from hicache.keys import as_token_bytes, chain_keys

            first = tier.codec.storage_keys(chain_keys(cache.controller.tree.seed, as_token_bytes(tokens[:PAGE]), PAGE))
            await tier.backend.delete(first)
            await router.sync(cache)
            withdrawn = [e for batch in router.batches for e in batch if isinstance(e, BlockRemoved)][-1]
            assert len(withdrawn.block_hashes) == 3 and withdrawn.medium == "DISK"
            assert router.index.hit(tokens, "a") == 0 == (await cache.lookup(tokens, prefetch=False)).tokens
            await cache.store(tokens[:PAGE], kv[:, :, :PAGE])  # the gap filled: pages 2 and 3 serve again
            await router.sync(cache)
            assert router.index.hit(tokens, "a") == 3 * PAGE == (await cache.lookup(tokens, prefetch=False)).tokens
        finally:
            router.close()


def test_events_are_refused_for_hybrid_models(tmp_path) -> None:
    from hicache.errors import ConfigError

    cfg = events_config(tmp_path, model={"layers": ["full", "sliding:8", "full", "sliding:8"]})
    with pytest.raises(ConfigError, match="hybrid model"):
        HiCache.from_config(cfg)


async def test_replay_requests_are_rate_limited_and_junk_is_ignored(tmp_path) -> None:
    import zmq

    cfg = events_config(tmp_path)
    async with HiCache.from_config(cfg) as cache:
        pub = cache.events.sink
        await anyio.to_thread.run_sync(pub.flush)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pub.bound_replay_endpoint)
        try:
            sock.send_multipart((b"", b"not a sequence number"))  # ignored: nothing answered
            for _ in range(60):
                sock.send_multipart((b"", (0).to_bytes(8, "big")))
            ends = 0
            deadline = anyio.current_time() + 5
            while anyio.current_time() < deadline and ends < 60:
                if not await anyio.to_thread.run_sync(sock.poll, 300):
                    break
                frames = sock.recv_multipart()
                ends += frames[2] == (-1).to_bytes(8, "big", signed=True)
        finally:
            sock.close(0)
        assert 0 < ends < 60 and pub.refused_replays > 0
