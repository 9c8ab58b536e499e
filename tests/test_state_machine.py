"""Random programs of store / lookup / retrieve / lease / cancel / evict against tiny tiers.

Hypothesis draws a small pool of token sequences (built from a few page patterns, so prefixes are
shared and nodes split all the time) and a list of operations over them; each example runs the whole
program inside one ``anyio.run`` (the cache owns a task group, so it must be entered and exited in
one task). After every step the program checks, against a model of what was stored:

1. page accounting is exact once background work settled (``assert_consistent``: no leaked page,
   no double free, ``lock_ref`` equals the live leases);
2. a leased prefix is never evicted: its device pages stay allocated, stay the pages of the pinned
   path, and still read back bit-exact;
3. every retrieve returns, bit-exact, the KV stored for the prefix it reports, and that prefix was
   stored;
4. ``lookup`` is page-aligned, within the query, and agrees with an immediately following retrieve
   (which may only be shorter when the host-only part could not be loaded for lack of device room);
5. at the end, with nothing leased and nothing in flight, the whole device can be reserved (also
   with a host tier smaller than most nodes: pages leave by runs).

KV is a pure function of the token prefix (a rolling hash of ``tokens[:t+1]`` per position, plus an
offset per component/layer/head/dim, all exactly representable in float32), so two sequences with a
common prefix have identical KV on it, and a page served from the wrong node is caught.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import HiCache, HiCacheConfig
from hicache.errors import CapacityError
from hicache.leases import RetrieveView

from .conftest import make_config
from .helpers import assert_consistent, pinned_nodes

PAGE = 4
DEVICE_PAGES = 8
HOST_PAGES = 24
MAX_TOKENS = 40
MAX_HELD = 3

# Sequences are runs of these page patterns, so different sequences share page-aligned prefixes and
# diverge inside stored nodes (splits); patterns differing only in their last token check that a page
# matches only when all of its tokens do.
PATTERNS = [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 1), (1, 2, 3, 0)]


# -- the KV model ---------------------------------------------------------------------------------


def kv_for(config: HiCacheConfig, tokens: list[int]) -> torch.Tensor:
    """``[C, L, T, H, D]`` KV that depends only on the prefix ending at each position."""
    m = config.model
    c, layers, heads, dim = m.kv_components, config.num_cache_layers, m.num_kv_heads, m.head_dim
    h, hashes = 7, []
    for tok in tokens:
        h = (h * 31 + tok + 1) % 65521
        hashes.append(h)
    # Wider models (the compact host's) repeat offsets across elements: still one value per prefix.
    offsets = (torch.arange(c * layers * heads * dim, dtype=torch.float64) % 128).reshape(c, layers, 1, heads, dim)
    base = torch.tensor(hashes, dtype=torch.float64).reshape(1, 1, len(tokens), 1, 1) * 128
    return (base + offsets).to(m.torch_dtype)  # < 2**24: exact in float32


# -- operations -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    seq: int
    cut: int
    priority: int = 0


@dataclass(frozen=True)
class Retrieve:
    """``lookup`` then ``retrieve`` of the same tokens; keep the lease when ``hold``."""

    seq: int
    cut: int
    hold: bool = False


@dataclass(frozen=True)
class Release:
    which: int


@dataclass(frozen=True)
class Cancel:
    """Start a store or a retrieve in a task and cancel it after ``ticks`` scheduler turns."""

    seq: int
    cut: int
    ticks: int
    store: bool = False


@dataclass(frozen=True)
class Reserve:
    """Zero-copy store: reserve the missing pages (plus ``extra``), write KV in place, maybe commit."""

    seq: int
    cut: int
    extra: int = 0
    commit: bool = True


@dataclass(frozen=True)
class EvictDevice:
    pages: int


@dataclass(frozen=True)
class EvictHost:
    pages: int


@dataclass(frozen=True)
class Concurrent:
    """Stores and short retrieves racing each other (and the background workers)."""

    ops: tuple[Store | Retrieve, ...]


Op = Store | Retrieve | Release | Cancel | Reserve | EvictDevice | EvictHost | Concurrent

seq_strategy = st.builds(
    lambda pages, tail: [t for p in pages for t in PATTERNS[p]] + tail,
    st.lists(st.integers(0, len(PATTERNS) - 1), max_size=MAX_TOKENS // PAGE),
    st.lists(st.integers(0, 3), max_size=PAGE - 1),
).map(lambda s: s[:MAX_TOKENS])
idx = st.integers(0, 5)
cut = st.integers(0, MAX_TOKENS)
store_op = st.builds(Store, idx, cut, st.integers(0, 2))
retrieve_op = st.builds(Retrieve, idx, cut, st.booleans())
op_strategy: st.SearchStrategy[Op] = st.one_of(  # stores and retrieves weighted up; shrinks to Store(0, 0)
    store_op,
    retrieve_op,
    store_op,
    retrieve_op,
    st.builds(Release, st.integers(0, MAX_HELD - 1)),
    st.builds(Cancel, idx, cut, st.integers(0, 12), st.booleans()),
    st.builds(Reserve, idx, cut, st.integers(0, 2), st.booleans()),
    st.builds(EvictDevice, st.integers(1, DEVICE_PAGES)),
    st.builds(EvictHost, st.integers(1, HOST_PAGES)),
    st.builds(Concurrent, st.lists(st.one_of(store_op, retrieve_op), min_size=2, max_size=4).map(tuple)),
)
program_strategy = st.tuples(
    st.lists(seq_strategy, min_size=1, max_size=6),
    st.lists(op_strategy, min_size=15, max_size=40),  # min_size: Store(0, 0) is a no-op
)


# -- the runner -----------------------------------------------------------------------------------


@dataclass
class Held:
    lease: Any
    view: RetrieveView
    tokens: list[int]


@dataclass
class Machine:
    cache: HiCache
    config: HiCacheConfig
    pool: list[list[int]]
    stored: list[list[int]] = field(default_factory=list)  # full-page parts of every store issued
    held: list[Held] = field(default_factory=list)

    def tokens(self, seq: int, cut: int) -> list[int]:
        return self.pool[seq % len(self.pool)][:cut]

    def was_stored(self, tokens: list[int], n: int) -> bool:
        return n == 0 or any(len(s) >= n and s[:n] == tokens[:n] for s in self.stored)

    def checkpoints(self, tokens: list[int]) -> list[int] | None:
        """A recurrent model's store: checkpoints after every second page and at the end."""
        if not self.config.model.layers.recurrent:
            return None
        full = len(tokens) // PAGE * PAGE
        return sorted({*range(2 * PAGE, full + 1, 2 * PAGE), full} - {0})

    def was_checkpointed(self, tokens: list[int], n: int) -> bool:
        """Whether a store gave the page ending at ``n`` its checkpoint (any hit of a recurrent
        model must end on one: it continues from that state)."""
        return n == 0 or (n // PAGE) % 2 == 0 or any(s == tokens[:n] for s in self.stored)

    # -- checks ---------------------------------------------------------------------------------

    async def check_view(self, view: RetrieveView, tokens: list[int]) -> None:
        """The view's prefix was stored, sits in allocated device pages, and reads back bit-exact."""
        n = view.tokens
        assert n % PAGE == 0 and n <= len(tokens), f"retrieve reported {n} tokens of {len(tokens)}"
        assert self.was_stored(tokens, n), f"retrieve reported {n} tokens that were never stored"
        assert sum(view.by_tier.values()) == n, dict(view.by_tier)
        assert len(view.device_pages) == n // PAGE
        allocator = self.cache.controller.device.allocator
        freed = [p for p in view.device_pages if not allocator.is_allocated(p)]
        assert not freed, f"leased device pages {freed} were freed (evicted under a lease)"
        if view._pin is not None:
            path = self.cache.controller.tree.path_to(view._pin.node)
            assert all(nd.device is not None for nd in path), "a leased node lost its device copy"
            assert [p for nd in path for p in nd.device or []] == view.device_pages, "leased pages remapped"
        else:
            assert n == 0
        await view.wait_all()
        expected = kv_for(self.config, tokens[:n])
        kinds = self.config.cache_layers
        # A hybrid's sliding layers are exact in the window before the end; before it, a page read
        # back from a layer-split tier holds zeros there (thin), never other KV. A recurrent
        # model's hit ends on a checkpoint (the state layers of its last page), exact.
        window = n - kinds.window_pages(PAGE) * PAGE if kinds.splits else 0
        if self.config.model.layers.recurrent:
            assert self.was_checkpointed(tokens, n), f"a hit of {n} tokens ends on a page with no checkpoint"
        for layer in range(self.config.num_cache_layers):
            parts = view.layer(layer)
            assert len(parts) == expected.shape[0]
            for c, part in enumerate(parts):
                if layer in kinds.partial and window > 0:
                    head, want = part[:window], expected[c, layer, :window]
                    assert bool(((head == want) | (head == 0)).all()), f"sliding layer {layer} before the window"
                    part, want = part[window:], expected[c, layer, window:]
                else:
                    want = expected[c, layer]
                assert torch.equal(part, want), f"KV differs: layer {layer} component {c}, {n} tokens"

    async def check_step(self) -> None:
        # Structural invariants hold even while background work runs.
        assert_consistent(self.cache, pinned_nodes(h.view for h in self.held), quiescent=False)
        await self.cache.wait_idle()
        assert_consistent(self.cache, pinned_nodes(h.view for h in self.held))
        for h in self.held:
            await self.check_view(h.view, h.tokens)

    # -- operations -----------------------------------------------------------------------------

    async def store(self, op: Store) -> None:
        tokens = self.tokens(op.seq, op.cut)
        self.stored.append(tokens[: len(tokens) // PAGE * PAGE])
        result = await self.cache.store(
            tokens, kv_for(self.config, tokens), priority=op.priority, checkpoints=self.checkpoints(tokens)
        )
        full = len(tokens) // PAGE * PAGE
        assert result.stored_tokens + result.cached_tokens + result.dropped_tokens == full, result

    async def retrieve(self, op: Retrieve) -> None:
        tokens = self.tokens(op.seq, op.cut)
        hit = await self.cache.lookup(tokens)
        # Nothing may run between the lookup and the retrieve's own match.
        lease = self.cache.retrieve(tokens)
        view = await lease.__aenter__()
        try:
            assert hit.tokens % PAGE == 0 and 0 <= hit.tokens <= len(tokens), hit
            assert sum(hit.by_tier.values()) == hit.tokens, dict(hit.by_tier)
            assert self.was_stored(tokens, hit.tokens), f"lookup reported {hit.tokens} tokens never stored"
            # The device-resident part is pinned as matched; only the host-only tail may be cut short
            # (for lack of device room). A hybrid's hit then ends where a window is whole, which
            # may be inside the device part (its pages there read back thin earlier).
            assert view.tokens <= hit.tokens, (dict(hit.by_tier), view)
            if not self.config.cache_layers.splits:
                assert hit.by_tier["device"] <= view.tokens, (dict(hit.by_tier), view)
            await self.check_view(view, tokens)
        except BaseException:
            await lease.__aexit__(None, None, None)
            raise
        if op.hold and len(self.held) < MAX_HELD:
            self.held.append(Held(lease, view, tokens))
        else:
            await lease.__aexit__(None, None, None)

    async def reserve(self, op: Reserve) -> None:
        tokens = self.tokens(op.seq, op.cut)
        full = len(tokens) // PAGE
        first = (await self.cache.lookup(tokens)).tokens // PAGE
        want = full - first + op.extra
        try:
            async with self.cache.reserve(want) as slots:
                assert len(slots.pages) == want and len(set(slots.pages)) == want
                allocator = self.cache.controller.device.allocator
                assert all(allocator.is_allocated(p) for p in slots.pages)
                kv = kv_for(self.config, tokens)
                device_kv = self.cache.device_kv
                for i, page in enumerate(slots.pages[: full - first]):
                    start = (first + i) * PAGE
                    device_kv[:, :, page] = kv[:, :, start : start + PAGE]
                if op.commit:
                    self.stored.append(tokens[: full * PAGE])
                    # An engine names the checkpoints it wrote (vLLM's Mamba states), as a store does.
                    marks = self.checkpoints(tokens[: full * PAGE])
                    marks = None if marks is None else [m for m in marks if m > first * PAGE]
                    added = await slots.commit(tokens, first, checkpoints=marks)
                    assert added % PAGE == 0 and 0 <= added <= (full - first) * PAGE, added
        except CapacityError:
            # Legitimate only when eviction could not free enough (pinned / in-flight pages).
            assert self.cache.controller.device.free_pages < want

    async def short_retrieve(self, op: Retrieve) -> None:
        tokens = self.tokens(op.seq, op.cut)
        async with self.cache.retrieve(tokens) as view:
            await self.check_view(view, tokens)

    async def release(self, op: Release) -> None:
        if self.held:
            h = self.held.pop(op.which % len(self.held))
            await h.lease.__aexit__(None, None, None)
            assert h.view._released

    async def cancel(self, op: Cancel) -> None:
        tokens = self.tokens(op.seq, op.cut)
        if op.store:
            self.stored.append(tokens[: len(tokens) // PAGE * PAGE])  # it may complete before the cancel

        async def victim() -> None:
            if op.store:
                await self.cache.store(tokens, kv_for(self.config, tokens))
            else:
                async with self.cache.retrieve(tokens) as view:
                    await self.check_view(view, tokens)
            await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            for _ in range(op.ticks):
                await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()

    async def concurrent(self, op: Concurrent) -> None:
        async with anyio.create_task_group() as tg:
            for sub in op.ops:
                if isinstance(sub, Store):
                    tg.start_soon(self.store, sub)
                else:
                    tg.start_soon(self.short_retrieve, sub)

    async def step(self, op: Op) -> None:
        evictor = self.cache.controller.evictor
        match op:
            case Store():
                await self.store(op)
            case Retrieve():
                await self.retrieve(op)
            case Release():
                await self.release(op)
            case Cancel():
                await self.cancel(op)
            case Reserve():
                await self.reserve(op)
            case EvictDevice():
                await evictor.evict_device(op.pages)
            case EvictHost():
                await evictor.evict_host(op.pages)
            case Concurrent():
                await self.concurrent(op)
        await self.check_step()


async def run_program(config: HiCacheConfig, pool: list[list[int]], ops: list[Op]) -> None:
    async with HiCache.from_config(config) as cache:
        machine = Machine(cache, config, pool)
        try:
            await machine.check_step()
            for op in ops:
                await machine.step(op)
        finally:
            with anyio.CancelScope(shield=True):
                while machine.held:
                    await machine.held.pop().lease.__aexit__(None, None, None)
        await machine.check_step()
        assert cache.controller.tree.root.lock_ref == 1
        # Nothing leased, nothing in flight: every page of the device can be had, however large
        # the nodes are against the host (pages leave by runs).
        async with cache.reserve(cache.controller.device.num_pages) as slots:
            assert len(slots.pages) == cache.controller.device.num_pages
        await machine.check_step()


MAX_EXAMPLES = int(os.environ.get("HICACHE_STATE_MACHINE_EXAMPLES", "30"))

CONFIGS = [
    pytest.param({"policies": {"write": write, "eviction": eviction}}, id=f"{write}-{eviction}")
    for write in ("write_through", "write_through_selective", "write_back")
    for eviction in ("lru", "lfu", "fifo", "priority")
] + [
    pytest.param(
        {
            "policies": {"write": "write_through", "eviction": "scan_resistant_lru", "prefetch": "wait_complete",
                         "prefetch_threshold_tokens": 0},
            "tiers": {"storage": [{"kind": "memory", "capacity": 24 * 2048}]},
            "controller": {"storage_batch_bytes": 2 * 2048},
        },
        id="write_through-storage-scan_resistant_lru",
    )
] + [
    pytest.param(
        {"policies": {"write": write}, "tiers": {"host": {"layout": "layer_first"}}, "io": {"backend": "direct"}},
        id=f"{write}-layer_first-direct",
    )
    for write in ("write_through", "write_back")
] + [
    pytest.param(
        {
            "policies": {"write": write, "prefetch": prefetch, "prefetch_threshold_tokens": 0},
            "tiers": {"storage": [{"kind": "memory", "capacity": 24 * 2048}]},
            "controller": {"storage_batch_bytes": 2 * 2048},
        },
        id=f"{write}-storage-{prefetch}",
    )
    for write, prefetch in (
        ("write_through", "wait_complete"), ("write_back", "timeout"), ("write_through", "best_effort")
    )
]


# A sliding-window hybrid over a layer-split storage tier: pages come back thin (sliding layers
# only near the ends of what was written) and hits end where a window is whole.
HYBRID = {"model": {"layers": ["sliding:8", "full", "sliding:8", "full"]}}
CONFIGS += [
    pytest.param(
        HYBRID | {
            "policies": {"write": write, "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
            "tiers": {"storage": [{"kind": "memory", "capacity": 48 * 2048}]},
            "controller": {"storage_batch_bytes": 2 * 2048},
        },
        id=f"hybrid-{write}-storage",
    )
    for write in ("write_through", "write_back")
]


# The same hybrid on a compact host (``tiers/shed.py``): 4 KiB a layer and component, so a page's
# sliding layers can give their memory back; nodes shed them outside the 3 pages at their end
# before the host evicts anything, and pages read back thin never hold their memory.
COMPACT = {"model": {"layers": ["sliding:8", "full", "sliding:8", "full"], "head_dim": 128}}
COMPACT_PAGE_BYTES = 2 * 4 * PAGE * 2 * 128 * 4
COMPACT_CONFIGS = [
    pytest.param(
        COMPACT | {
            "policies": {"write": write, "window_slack_tokens": 0},
            "tiers": {"host": {"compact": True}} | storage,
        },
        id=f"compact-hybrid-{write}{'-storage' if storage else ''}",
    )
    for write, storage in (
        ("write_through", {}),
        ("write_back", {"storage": [{"kind": "memory", "capacity": 48 * COMPACT_PAGE_BYTES}]}),
        ("write_through", {"storage": [{"kind": "memory", "capacity": 48 * COMPACT_PAGE_BYTES}]}),
    )
]
for param in COMPACT_CONFIGS[-2:]:  # the storage ones prefetch
    param.values[0]["policies"] |= {"prefetch": "wait_complete", "prefetch_threshold_tokens": 0}
    param.values[0]["controller"] = {"storage_batch_bytes": 2 * COMPACT_PAGE_BYTES}


@pytest.mark.parametrize("overrides", CONFIGS)
def test_configs_hold_the_intended_pages(overrides: dict[str, Any]) -> None:
    """The nested overrides must not clobber the tiny capacities the programs rely on."""
    config = make_config(DEVICE_PAGES, HOST_PAGES, **overrides)
    assert config.page_size == PAGE
    assert config.tiers.device.capacity == DEVICE_PAGES * config.page_bytes
    assert config.tiers.host.capacity == HOST_PAGES * config.page_bytes
    assert config.policies.write == overrides["policies"]["write"]
    if "io" in overrides:
        assert (config.tiers.host.layout, config.io.backend) == ("layer_first", "direct")


def fuzzed(test: Any) -> Any:
    """A test over hypothesis programs, with no deadline (a program runs a whole cache)."""
    return settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(given(program=program_strategy)(test))


@pytest.mark.parametrize("overrides", CONFIGS)
@fuzzed
def test_random_programs(overrides: dict[str, Any], program: tuple[list[list[int]], list[Op]]) -> None:
    config = make_config(DEVICE_PAGES, HOST_PAGES, **overrides)
    pool, ops = program
    anyio.run(run_program, config, pool, ops)


SMALL_HOST_PAGES = 3  # smaller than most nodes: pages move between tiers by runs (split nodes)
SMALL_HOST_CONFIGS = [
    pytest.param({"policies": {"write": "write_through"}}, id="write_through"),
    pytest.param({"policies": {"write": "write_back"}}, id="write_back"),
    pytest.param(
        {
            "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
            "tiers": {"storage": [{"kind": "memory", "capacity": 64 * 2048}]},
            "controller": {"storage_batch_bytes": 2 * 2048},
        },
        id="write_through-storage",
    ),
    pytest.param(
        HYBRID | {
            "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
            "tiers": {"storage": [{"kind": "memory", "capacity": 64 * 2048}]},
            "controller": {"storage_batch_bytes": 2 * 2048},
        },
        id="hybrid-write_through-storage",
    ),
]


@pytest.mark.parametrize("overrides", SMALL_HOST_CONFIGS)
@fuzzed
def test_random_programs_with_a_host_smaller_than_a_node(
    overrides: dict[str, Any], program: tuple[list[list[int]], list[Op]]
) -> None:
    config = make_config(DEVICE_PAGES, SMALL_HOST_PAGES, **overrides)
    pool, ops = program
    anyio.run(run_program, config, pool, ops)


# A recurrent hybrid (``layer_kinds``): two layers keep a state of 800 and 400 bytes (2 and 1
# state layers of a page), checkpointed every second page and at each store's and commit's end;
# pages in between and pages read back before a segment's end are thin. Its storage
# tier is layer-split: checkpoints are parts of their own.
RECURRENT = {"model": {"layers": ["recurrent:s=200/float32", "full", "recurrent:s=100/float32", "full"]}}
RECURRENT_PAGE_BYTES = 5 * 2 * PAGE * 2 * 8 * 4
RECURRENT_CONFIGS = [
    pytest.param(RECURRENT | {"policies": {"write": "write_back", "eviction": "lfu"}}, id="recurrent-write_back"),
] + [
    pytest.param(
        RECURRENT | {
            "policies": {"write": write, "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
            "tiers": {"storage": [{"kind": "memory", "capacity": 48 * RECURRENT_PAGE_BYTES}]},
            "controller": {"storage_batch_bytes": 2 * RECURRENT_PAGE_BYTES},
        },
        id=f"recurrent-{write}-storage",
    )
    for write in ("write_through", "write_back")
]


@pytest.mark.parametrize("overrides", RECURRENT_CONFIGS)
@fuzzed
def test_random_programs_with_recurrent_checkpoints(
    overrides: dict[str, Any], program: tuple[list[list[int]], list[Op]]
) -> None:
    config = make_config(DEVICE_PAGES, HOST_PAGES, **overrides)
    assert config.num_cache_layers == 5 and config.page_bytes == RECURRENT_PAGE_BYTES
    pool, ops = program
    anyio.run(run_program, config, pool, ops)


COMPACT_HOST_PAGES = 10  # holds a few nodes whole: host-only nodes longer than their window shed


@pytest.mark.parametrize("overrides", COMPACT_CONFIGS)
@fuzzed
def test_random_programs_on_a_compact_host(overrides: dict[str, Any], program: tuple[list[list[int]], list[Op]]) -> None:
    config = make_config(DEVICE_PAGES, COMPACT_HOST_PAGES, **overrides)
    pool, ops = program
    anyio.run(run_program, config, pool, ops)
