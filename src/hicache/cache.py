"""``HiCache``: the public face of the library.

    async with HiCache.from_config(load_config("config/default.yaml")) as cache:
        hit = await cache.lookup(tokens)               # moves no data
        await cache.store(tokens, kv)                  # kv: [C, L, len(tokens), H, D]
        async with cache.retrieve(tokens) as view:     # pinned until the block exits
            await view.wait_layer(0)
            k, v = view.layer(0)

Every call validates its arguments before touching any state, so a rejected call leaves the cache
unchanged. All index and allocator state is changed on the event loop thread only; worker threads
copy pages that are pinned or not yet published in the index.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import torch

from .config import StorageTierConfig
from .controller.loadback import bring_up, restorable_path
from .controller.persist import persist
from .errors import CapacityError, ConfigError, InvalidKVError, InvalidRequestError
from .keys import TOKEN_BYTES, Namespace, as_token_bytes
from .leases import HeldPrefix, Lease, RetrieveView, SlotReservation
from .radix_tree import Pin
from .stats import CacheStats, TierStats

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Mapping

    from .config import HiCacheConfig
    from .controller.controller import CacheController
    from .controller.jobs import LoadJob
    from .controller.prefetch import Prefetch
    from .controller.storage_chain import StorageChange
    from .events.journal import EventJournal
    from .tiers.storage.tier import StorageTier

__all__ = ["HiCache", "Hit", "StoreResult"]


@dataclass(frozen=True)
class Hit:
    """What ``lookup`` found: the cached prefix length (whole pages) and which tier holds it.

    ``by_tier`` names ``device``, ``host`` and each storage tier. ``prefetch`` is the prefetch that
    brings the storage part into host memory (``None`` when there is nothing, or too little, to
    fetch): ``cancel()`` it when the request is dropped before it runs.
    """

    tokens: int
    by_tier: Mapping[str, int]
    prefetch: Prefetch | None = None


@dataclass(frozen=True)
class StoreResult:
    """What ``store`` did: tokens newly cached, tokens that were cached already, tokens dropped."""

    stored_tokens: int
    cached_tokens: int
    dropped_tokens: int = 0


class HiCache(anyio.AsyncContextManagerMixin):
    """A hierarchical KV cache: device and host tiers under one radix index."""

    #: What ``from_config`` builds with: the composition root's ``containers.build_cache``, which it
    #: installs as ``hicache`` is imported (this module never imports the composition root).
    _builder: ClassVar[Callable[[HiCacheConfig], HiCache] | None] = None

    def __init__(
        self,
        config: HiCacheConfig,
        controller: CacheController,
        namespace: Namespace,
        *,
        build_storage_tier: Callable[[StorageTierConfig], StorageTier] | None = None,
        check_storage_entry: Callable[..., StorageTierConfig] | None = None,
        events: EventJournal | None = None,
    ) -> None:
        self.config = config
        self.controller = controller
        self.namespace = namespace
        #: KV events for routers (``kv_events``; docs/routing.md), or None when off.
        self.events = events
        self._build_storage_tier = build_storage_tier
        self._check_storage_entry = check_storage_entry
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the cache runs on, while open
        g = controller.device.geometry
        self._geometry = g
        self._page_size = g.page_size
        self._page_bytes = g.page_size * TOKEN_BYTES

    @classmethod
    def from_config(cls, config: HiCacheConfig) -> HiCache:
        """Build a cache and all its parts from a config (through the composition root)."""
        if HiCache._builder is None:  # pragma: no cover - `import hicache` installs it
            raise RuntimeError("no composition root installed: import hicache (hicache.containers)")
        return HiCache._builder(config)

    @staticmethod
    def install_builder(build: Callable[[HiCacheConfig], HiCache]) -> None:
        """Set what ``from_config`` builds with (the composition root does, once)."""
        HiCache._builder = build

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[HiCache]:
        from .logs import configure, set_repeat_interval

        settings = self.config.logging
        if settings.level is not None or settings.format is not None:
            configure(settings.level, settings.format, settings.repeat_interval_s)
        else:
            set_repeat_interval(settings.repeat_interval_s)  # leave the application's logging alone
        try:
            async with self.controller, self._events_open():
                self.loop = asyncio.get_running_loop()
                try:
                    yield self
                finally:
                    self.loop = None
        except BaseExceptionGroup as group:
            # The controller's task group wraps whatever ended it; a lone error (the caller's own,
            # or a failed worker's WorkerFailedError) is clearer unwrapped.
            if len(group.exceptions) == 1:
                error = group.exceptions[0]
                raise error from error.__cause__
            raise

    @asynccontextmanager
    async def _events_open(self) -> AsyncGenerator[None]:
        """Publish KV events while open: everything announced before is cleared first (a restart
        forgets what the last process held) and again at close."""
        journal = self.events
        if journal is None:
            yield
            return
        ctl = self.controller
        journal.open()
        try:
            ctl.tree.residency_hook = journal.residency
            for tier in ctl.storage:
                journal.watch(tier)
            yield
        finally:
            ctl.tree.residency_hook = None
            for tier in ctl.storage:
                journal.unwatch(tier)
            journal.close()

    # -- public properties ----------------------------------------------------------------------

    @property
    def device_kv(self) -> torch.Tensor:
        """The device pool ``[C, L, pages, page_size, H, D]``, for engines that read it in place."""
        self.controller.check_open()
        return self.controller.device.kv

    @property
    def page_size(self) -> int:
        return self._page_size

    # -- validation -----------------------------------------------------------------------------

    def _check_kv(self, kv: Any, num_tokens: int) -> None:
        g = self._geometry
        expected = (g.components, g.num_layers, num_tokens, g.num_kv_heads, g.head_dim)
        layout = "[1, num_layers, tokens, 1, latent_dim]" if g.components == 1 else "[2, num_layers, tokens, num_kv_heads, head_dim]"
        if not isinstance(kv, torch.Tensor):
            raise InvalidKVError(f"kv must be a torch.Tensor {layout}, got {type(kv).__name__}")
        # Checked before anything is evicted: a tensor that cannot be read would fail mid-copy.
        if kv.layout is not torch.strided:
            raise InvalidKVError(f"kv must be a dense (strided) tensor, got layout {kv.layout}; call .to_dense()")
        if kv.device.type == "meta":
            raise InvalidKVError("kv is on the meta device (it has no data); pass a tensor that holds the KV")
        if kv.dtype != g.dtype:
            raise InvalidKVError(f"kv dtype must be {g.dtype} (the configured model dtype), got {kv.dtype}")
        if tuple(kv.shape) != expected:
            if kv.dim() == 5 and kv.shape[2] != num_tokens and (kv.shape[:2], kv.shape[3:]) == (expected[:2], expected[3:]):
                raise InvalidKVError(
                    f"kv holds {kv.shape[2]} tokens but {num_tokens} token ids were given (after start)"
                )
            raise InvalidKVError(f"kv shape must be {layout} = {list(expected)}, got {list(kv.shape)}")

    # -- lookup ---------------------------------------------------------------------------------

    async def lookup(self, tokens: Any, *, prefetch: bool = True) -> Hit:
        """Length of the longest cached prefix and the tiers holding it.

        Moves no data itself; with storage tiers, it asks them for the pages after the memory
        part, and (``prefetch=True``, at least ``prefetch_threshold_tokens``) starts bringing those
        into host memory in the background, so a later ``retrieve`` finds them there.
        """
        ctl = self.controller
        ctl.check_open()
        tb = as_token_bytes(tokens)
        t0 = time.perf_counter()
        match = ctl.tree.match(tb)
        runs: list[tuple[str, int]] = []  # (tier, pages) in prefix order
        for i, node in enumerate(match.path):
            pages = match.last_pages if i == len(match.path) - 1 else node.num_pages
            runs.append(("device" if node.device is not None else "host", pages))
        ctl.counters.lookups += 1
        stored, started = await ctl.prefetcher.lookup(tb, match, start=prefetch)
        if stored is not None:
            runs += [(tier.name, n) for tier, _, n in stored.segments]
        # No hit ends where a sliding layer's window is not all there (``HiRadixTree.restorable``).
        total = sum(n for _, n in runs)
        left = ctl.tree.restorable(match.path, total, stored.thin() if stored is not None else ())
        by_tier = {"device": 0, "host": 0} | {tier.name: 0 for tier in ctl.storage}
        for name, n in runs:
            by_tier[name] = by_tier.get(name, 0) + min(n, left) * self._page_size
            left -= min(n, left)
        ctl.counters.latency["lookup"].observe(time.perf_counter() - t0)
        return Hit(sum(by_tier.values()), MappingProxyType(by_tier), started)

    # -- store ----------------------------------------------------------------------------------

    async def store(
        self, tokens: Any, kv: torch.Tensor, *, start: int = 0, priority: int = 0,
        checkpoints: Iterable[int] | None = None,
    ) -> StoreResult:
        """Cache the full pages of ``tokens`` that are not cached yet (see ``_store``); timed."""
        started = time.perf_counter()
        result = await self._store(tokens, kv, start=start, priority=priority, checkpoints=checkpoints)
        self.controller.counters.latency["store"].observe(time.perf_counter() - started)
        return result

    async def _store(
        self, tokens: Any, kv: torch.Tensor, *, start: int = 0, priority: int = 0,
        checkpoints: Iterable[int] | None = None,
    ) -> StoreResult:
        """Cache the full pages of ``tokens`` that are not cached yet.

        ``kv``: ``[2, num_layers, len(tokens) - start, num_kv_heads, head_dim]`` (MLA: ``[1, L, T, 1, D]``),
        the KV of ``tokens[start:]``. An engine that retrieved a prefix passes ``start=view.tokens``
        and only the KV it computed; ``start`` is a multiple of ``page_size``, and pages after a gap
        (``tokens[:start]`` no longer cached) cannot be attached and are dropped.
        Where the new pages go and which copies they are owed is the controller's decision
        (``controller/placement.py``, ``controller/residency.py``): this validates, calls, reports.

        A model with recurrent layers names its ``checkpoints``: the token counts ``L`` (multiples
        of ``page_size`` in ``(start, len(tokens)]``) after which ``kv`` holds the layers' state,
        in the ``state`` layers of the page ending at ``L`` (``layer_kinds``). The other pages are
        cached *thin*: a hit can pass them but never end on them.
        """
        ctl = self.controller
        ctl.check_open()
        tb = as_token_bytes(tokens)
        num_tokens = len(tb) // TOKEN_BYTES
        ps = self._page_size
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= num_tokens or start % ps:
            raise InvalidRequestError(
                f"start must be a multiple of page_size ({ps}) in [0, {num_tokens}], got {start!r}"
            )
        self._check_kv(kv, num_tokens - start)
        _check_priority(priority)
        whole = self._checkpoint_pages(checkpoints, start, num_tokens)
        placed = await ctl.store(tb, kv, start=start, priority=priority, whole=whole)
        return StoreResult(placed.stored * ps, placed.cached * ps, placed.dropped * ps)

    def _checkpoint_pages(self, checkpoints: Iterable[int] | None, start: int, num_tokens: int) -> frozenset[int] | None:
        """The pages a store's ``checkpoints`` make whole, validated (``None``: not a recurrent model)."""
        recurrent = bool(self.config.model.layers.recurrent)
        if checkpoints is None:
            return frozenset() if recurrent else None
        if not recurrent:
            raise InvalidRequestError("checkpoints are for models with recurrent layers; this model has none")
        ps = self._page_size
        out = set()
        for at in checkpoints:
            if isinstance(at, bool) or not isinstance(at, int) or at % ps or not start < at <= num_tokens:
                raise InvalidRequestError(
                    f"a checkpoint is a multiple of page_size ({ps}) in ({start}, {num_tokens}], got {at!r}"
                )
            out.add(at // ps - 1)
        return frozenset(out)

    # -- retrieve -------------------------------------------------------------------------------

    def retrieve(self, tokens: Any) -> Lease:
        """Lease the longest cached prefix of ``tokens`` on the device tier.

        ``async with cache.retrieve(tokens) as view``: the prefix is pinned until the block exits;
        pages found only on the host are loaded back layer by layer (see ``RetrieveView``). A
        prefix larger than the host tier can hold (or pin) comes up by runs: a run is loaded to
        the device, its host pages may go, the next run follows (from the host or from storage).
        """
        self.controller.check_open()
        tb = as_token_bytes(tokens)
        return Lease(lambda: self._acquire_view(tb))

    async def _acquire_view(self, tb: bytes) -> RetrieveView:
        ctl = self.controller
        ctl.check_open()
        ps = self._page_size
        num_tokens = len(tb) // TOKEN_BYTES
        started = time.perf_counter()
        ctl.counters.retrieves += 1
        brought = await bring_up(ctl, tb)
        path, pin, jobs, loaded, from_storage = (
            brought.path, brought.pin, brought.jobs, brought.loaded, brought.from_storage,
        )
        try:
            for job in {id(nd.loading): nd.loading for nd in path if nd.loading is not None}.values():
                if job not in jobs:
                    jobs.append(job)
            ctl.tree.touch(path)
            # Fixed now: the pages are pinned, so later splits cannot change what the view holds.
            hit_pages = sum(nd.num_pages for nd in path)
            device_pages = [p for nd in path for p in (nd.device or [])]
            await ctl.owe_copies(path, hit=True, wait=False)  # selective write-through: copies once hot
        except BaseException:
            if pin is not None:
                pin.release()
            raise
        device_tokens = (hit_pages - loaded) * ps
        by_tier = {"device": device_tokens, "host": loaded * ps} | {tier.name: 0 for tier in ctl.storage}
        for name, pages in from_storage.items():
            by_tier[name] = by_tier.get(name, 0) + pages * ps  # its tier may have been detached since
            by_tier["host"] -= pages * ps
        self._count_retrieve(num_tokens, by_tier)
        self._time_retrieve(started, jobs)
        return RetrieveView(
            tokens=hit_pages * ps,
            by_tier=by_tier,
            device_pages=device_pages,
            jobs=jobs,
            pin=pin,
            device_pool=ctl.device,
            read_layer=self._read_layer,
            check_open=ctl.check_open,
        )

    def _time_retrieve(self, started: float, jobs: list[LoadJob]) -> None:
        """Observe when layer 0 and the last layer are usable: now, or when the loads say so."""
        latency = self.controller.counters.latency
        waiting = [job for job in jobs if not job.finished.is_set()]
        if not waiting:
            elapsed = time.perf_counter() - started
            latency["retrieve_first_layer"].observe(elapsed)
            latency["retrieve_last_layer"].observe(elapsed)
            return
        pending = {"first": {id(j) for j in waiting if not j.is_ready(0)}, "last": {id(j) for j in waiting}}
        if not pending["first"]:
            latency["retrieve_first_layer"].observe(time.perf_counter() - started)

        def watcher(job: LoadJob) -> Callable[[str], None]:
            def seen(what: str) -> None:
                left = pending[what]
                if id(job) in left:
                    left.discard(id(job))
                    if not left:
                        latency[f"retrieve_{what}_layer"].observe(time.perf_counter() - started)

            return seen

        for job in waiting:
            job.watchers.append(watcher(job))

    def _read_layer(self, device_pages: list[int], layer: int) -> tuple[torch.Tensor, ...]:
        self.controller.check_open()  # the pool is gone once the cache is closed
        out = self.controller.engine.device_layer(device_pages, layer)
        self.controller.counters.bytes_moved["device_to_user"] += sum(t.numel() * t.element_size() for t in out)
        return out

    def _count_retrieve(self, num_tokens: int, by_tier: Mapping[str, int]) -> None:
        ctl = self.controller
        c = ctl.counters
        c.hit_tokens["device"] += by_tier["device"]
        c.miss_tokens["device"] += num_tokens - by_tier["device"]
        c.hit_tokens["host"] += by_tier["host"]
        missing = num_tokens - by_tier["device"] - by_tier["host"]
        c.miss_tokens["host"] += missing
        for tier in ctl.storage:  # in chain order: a tier is asked for what the ones above did not supply
            supplied = by_tier.get(tier.name, 0)
            tier.hit_tokens += supplied
            missing -= supplied
            tier.miss_tokens += missing

    # -- zero-copy path -------------------------------------------------------------------------

    def reserve(self, num_pages: int, *, tier: str = "device") -> Lease:
        """Lease ``num_pages`` fresh pages to write KV into in place (see ``SlotReservation``).

        ``tier="host"``: pages of the host tier, for an engine whose own KV memory plays the device
        tier's part and copies its pages out itself (the vLLM connector); committed, they join the
        index as host pages, owed to storage as the residency rule says.
        """
        self.controller.check_open()
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise InvalidRequestError(f"num_pages must be a non-negative int, got {num_pages!r}")
        if tier not in ("device", "host"):
            raise InvalidRequestError(f"tier must be 'device' or 'host', got {tier!r}")
        ctl = self.controller
        pool = ctl.device if tier == "device" else ctl.host
        if num_pages > pool.capacity_pages:
            # Checked first: evicting the whole tier and then failing would leave it changed.
            raise CapacityError(
                f"reserve({num_pages}) asks for more pages than the {tier} tier has ({pool.capacity_pages})"
            )

        async def acquire() -> SlotReservation:
            alloc = ctl.evictor.alloc_device if tier == "device" else ctl.evictor.alloc_host
            pages = await alloc(num_pages)
            return SlotReservation(pages, pool, self._commit, pool.allocator.free)

        return Lease(acquire)

    async def _commit(self, reservation: SlotReservation, tokens: Any, first_page: int, priority: int,
                      checkpoints: Iterable[int] | None = None) -> int:
        ctl = self.controller
        ctl.check_open()
        tb = as_token_bytes(tokens)
        if not isinstance(first_page, int) or isinstance(first_page, bool) or first_page < 0:
            raise InvalidRequestError(f"first_page must be a non-negative int, got {first_page!r}")
        _check_priority(priority)
        end = (first_page + len(reservation.pages)) * self._page_size
        whole = self._checkpoint_pages(checkpoints, first_page * self._page_size, min(end, len(tb) // TOKEN_BYTES))
        # Validated: from here the pages belong to the cache (published, or freed by the index).
        on_host = reservation.tier is ctl.host
        placed = await ctl.commit(tb, first_page, reservation.hand_over(), priority, on_host=on_host, whole=whole)
        return placed.stored * self._page_size

    # -- holding a prefix in place ----------------------------------------------------------------

    def hold(self, tokens: Any, *, start: int = 0) -> Lease:
        """Lease the longest cached prefix of ``tokens`` pinned where it lies (see ``HeldPrefix``).

        For an engine that copies KV into its own memory itself: unlike ``retrieve``, nothing is
        loaded to the device tier (no device room is needed, so a prefix as long as the host tier
        holds is never cut short for want of it). Pages that only storage holds arrive in host
        memory first, as the prefetch policy's wait allows. ``start`` (a multiple of
        ``page_size``): tokens the caller holds already; only the pages after it are listed and
        counted as hits, and a prefix that ends before it holds nothing. As for ``retrieve``, the
        prefix ends where it can be continued: no thin page in a sliding window before its end, a
        recurrent model's on a checkpoint.
        """
        self.controller.check_open()
        tb = as_token_bytes(tokens)
        ps = self._page_size
        num_tokens = len(tb) // TOKEN_BYTES
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= num_tokens or start % ps:
            raise InvalidRequestError(f"start must be a multiple of page_size ({ps}) in [0, {num_tokens}], got {start!r}")
        return Lease(lambda: self._acquire_held(tb, start))

    async def _acquire_held(self, tb: bytes, start: int) -> HeldPrefix:
        ctl = self.controller
        ctl.check_open()
        ps = self._page_size
        started = time.perf_counter()
        ctl.counters.retrieves += 1
        # Storage pages arrive in host memory first; what the host could not take stays a miss.
        await ctl.prefetcher.before_retrieve(tb)
        # The hit ends where it can be continued (a recurrent model's: on a checkpoint).
        path, _ = restorable_path(ctl, ctl.tree.match(tb, split=True).path, None)
        first = start // ps
        hit_pages = sum(nd.num_pages for nd in path)
        # The node holding the first page after ``start`` is split there, so that pages the caller
        # holds are neither listed nor counted (nor their storage source taken).
        pos = 0
        for i, node in enumerate(path):
            if pos < first < pos + node.num_pages:
                path[i] = ctl.tree.split(node, first - pos)
                path.insert(i + 1, node)
                break
            pos += node.num_pages
        pin = Pin(path[-1]) if hit_pages > first else None
        segments: list[tuple[Any, list[int]]] = []
        by_tier = {"device": 0, "host": 0} | {tier.name: 0 for tier in ctl.storage}
        thin: list[tuple[int, int]] = []
        pos = 0
        for node in path:
            if node.thin:
                thin.append((pos, pos + node.thin))
            if pos >= first:
                # Host pages first: a node being loaded to the device (``loading``) has device pages
                # whose data has not arrived; its host pages are whole. Device-only nodes are whole.
                if node.host is not None:
                    segments.append((ctl.host, list(node.host)))
                    tier = "host"
                else:
                    segments.append((ctl.device, list(node.device or [])))
                    tier = "device"
                if node.source is not None:  # a prefetch brought it from storage: that tier supplied it
                    tier, node.source = node.source, None
                by_tier[tier] = by_tier.get(tier, 0) + node.num_pages * ps
            pos += node.num_pages
        held = path if pin is not None else []
        try:
            ctl.tree.touch(held)
            await ctl.owe_copies(held, hit=True, wait=False)  # selective write-through: copies once hot
        except BaseException:
            if pin is not None:
                pin.release()
            raise
        self._count_retrieve(len(tb) // TOKEN_BYTES - start, by_tier)
        elapsed = time.perf_counter() - started
        ctl.counters.latency["retrieve_first_layer"].observe(elapsed)
        ctl.counters.latency["retrieve_last_layer"].observe(elapsed)
        return HeldPrefix(
            tokens=hit_pages * ps, start=start, by_tier=by_tier, segments=segments, pin=pin, check_open=ctl.check_open,
            thin=tuple(thin),
        )

    # -- durability -------------------------------------------------------------------------------

    async def persist(self, tokens: Any, *, tier: str | None = None, retry_s: float = 0.0) -> int:
        """Make the cached prefix of ``tokens`` durable in storage tier ``tier``; the leading tokens
        (whole pages) that tier holds then, as the tier itself answers.

        For a hand-off (a prefill server telling a decode server that a prompt's KV is there):
        the prefix's host pages nobody wrote yet are written, writes already queued for it are
        waited for, and pages the tier has lost since they were written are written again (see
        ``controller/persist.py``). ``tier``: a storage tier's name (default: the first that takes
        writes). ``retry_s``: how long a failed write is tried again (0: it is not). Unbounded by
        itself: wrap it in a timeout. ``ConfigError`` for an unknown tier.
        """
        ctl = self.controller
        ctl.check_open()
        tb = as_token_bytes(tokens)
        return await persist(ctl, tb, self._storage_tier(tier), retry_s=retry_s) * self._page_size

    def _storage_tier(self, name: str | None) -> StorageTier:
        tiers = list(self.controller.storage)
        if name is None:
            for t in tiers:
                if t.backend.writable:
                    return t
            raise ConfigError("persist: no storage tier takes writes (configure one under tiers.storage)")
        for t in tiers:
            if t.name == name:
                return t
        raise ConfigError(f"persist: no storage tier named {name!r}; have {[t.name for t in tiers]}")

    # -- observability --------------------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Wait until background backups and load-backs queued so far have finished."""
        await self.controller.wait_idle()

    def stats(self) -> CacheStats:
        """A frozen snapshot of capacity, usage, hits, traffic and queues."""
        ctl = self.controller
        c = ctl.counters
        tiers = {
            tier.name: TierStats(
                capacity_pages=tier.capacity_pages,
                used_pages=tier.used_pages,
                page_bytes=self._geometry.page_bytes,
                hit_tokens=c.hit_tokens[tier.name],
                miss_tokens=c.miss_tokens[tier.name],
                evicted_pages=c.evicted_pages[tier.name],
                lost_pages=c.lost_pages[tier.name],
                shed_pages=tier.allocator.shed_pages,
                shed_bytes=tier.allocator.shed_bytes,
            )
            for tier in (ctl.device, ctl.host)
        }
        return CacheStats(
            tiers=MappingProxyType(tiers),
            bytes_moved=c.frozen(c.bytes_moved),
            lookups=c.lookups,
            retrieves=c.retrieves,
            stores=c.stores,
            stored_pages=c.stored_pages,
            dropped_pages=c.dropped_pages,
            backups=c.backups,
            backups_skipped=c.backups_skipped,
            spills=c.spills,
            loads=c.loads,
            queue_depths=MappingProxyType(ctl.queue_depths()),
            in_flight=ctl.jobs.count if hasattr(ctl, "jobs") else 0,
            storage=MappingProxyType({
                tier.name: replace(tier.stats(), position=i) for i, tier in enumerate(list(ctl.storage))
            }),
            prefetches=c.prefetches,
            prefetched_pages=c.prefetched_pages,
            storage_backups=c.storage_backups,
            spills_to_storage=c.spills_to_storage,
            short_retrieves=c.short_retrieves,
            short_retrieve_tokens=c.short_retrieve_tokens,
            eviction_waits=c.eviction_waits,
            eviction_wait_s=c.eviction_wait_s,
            sliding_shed_pages=c.sliding_shed_pages,
            latencies=MappingProxyType({name: h.snapshot() for name, h in c.latency.items()}),
        )

    # -- the storage chain at runtime -----------------------------------------------------------

    async def attach_storage(
        self, entry: Mapping[str, Any] | StorageTierConfig, position: int | None = None, *, from_request: bool = False
    ) -> StorageChange:
        """Add a storage tier while the cache runs: ``entry`` is one ``tiers.storage`` item (a dict
        as in YAML), validated as the config validates it; ``position`` 0 is the fastest (probed
        first), ``None`` the end. The backend is opened before anything changes, so a tier that
        cannot open (``ConfigError``, ``StorageBackendError``) leaves the cache as it was. Pages
        already in other tiers are not copied to it. See ``controller/storage_chain.py``.

        ``from_request=True`` (the admin endpoint): ``entry`` (a dict) came from outside the process,
        so its ``kind`` must be a built-in or an installed plugin (no class path: nothing is imported)
        and its settings read nothing from this process's environment (``config.REQUEST_CONTEXT``).
        """
        self.controller.check_open()
        if self._build_storage_tier is None or self._check_storage_entry is None:
            raise ConfigError("this cache was not built by HiCache.from_config: it cannot build storage tiers")
        if isinstance(entry, StorageTierConfig):
            if from_request:
                raise ConfigError("attach_storage: an entry from a request is a mapping, validated here")
            validated = entry
        else:
            validated = self._check_storage_entry(entry, "attach_storage", from_request=from_request)
        tier = self._build_storage_tier(validated)
        change = await self.controller.attach_storage(tier, position)
        if self.events is not None:
            self.events.watch(tier)
        storage = list(self.config.tiers.storage)
        storage.insert(change.position, validated)
        self._set_storage_config(storage)
        return change

    async def detach_storage(self, name: str, *, drain: bool = True, timeout_s: float | None = None) -> StorageChange:
        """Remove storage tier ``name`` while the cache runs, then close it.

        ``drain=True`` lets the writes and prefetches already using it finish (at most ``timeout_s``,
        default ``controller.shutdown_timeout_s``); ``drain=False`` cancels those prefetches and lets
        those writes skip it. Requests in flight see a shorter chain, never an error; no page the
        write policy promised to another tier is lost, and none is counted lost for this one.
        """
        tier = next((t for t in self.controller.storage if t.name == name), None)
        change = await self.controller.detach_storage(name, drain=drain, timeout_s=timeout_s)
        if self.events is not None and tier is not None:
            self.events.unwatch(tier)  # its pages are no longer this instance's to serve
        self._set_storage_config([e for e in self.config.tiers.storage if e.tier_name != name])
        return change

    def _set_storage_config(self, storage: list[StorageTierConfig]) -> None:
        """``self.config`` describes the chain as it is now (already validated: no re-validation)."""
        tiers = self.config.tiers.model_copy(update={"storage": storage})
        self.config = self.config.model_copy(update={"tiers": tiers})

    def __repr__(self) -> str:
        d, h = self.controller.device, self.controller.host
        return f"<HiCache device={d.used_pages}/{d.num_pages} host={h.used_pages}/{h.num_pages} pages>"


def _check_priority(priority: Any) -> None:
    """Priorities order eviction (``policies.eviction: priority``): any int, higher kept longer."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an int (higher is kept longer), got {priority!r}")
