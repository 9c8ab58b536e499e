"""Prefetch: bring pages that only storage holds into host memory before a request needs them.

``lookup`` (at enqueue time) or ``retrieve`` asks each storage tier how many of the pages after the
memory-resident prefix it holds (``exists``; keys are chained, so the answer is a prefix length),
and when that is at least ``prefetch_threshold_tokens`` starts a ``Prefetch``: a task in the
controller's task group that reserves host pages a few batches at a time, reads and verifies them
(``StorageTier.fetch``, which reads the next batch while verifying one) and publishes each batch in
the index as host-only nodes as soon as it is verified. A request that arrives for the same pages
joins the running prefetch instead of starting another.

A prefetch pins what it publishes until a retrieve takes it, and pins at most the host's
``pin_room`` (``Evictor.wait_pin_room``: the host keeps room for pages leaving the device). When
that stops it short of the pages storage holds (a host tier smaller than the prefix, or filled by
other requests' pins), ``before_retrieve`` says so (``StorageRest``): the retrieve loads what
arrived to the device, which frees that host room, and asks again, so a prefix larger than the
host comes up run by run within the policy's one wait.

``retrieve`` waits as the prefetch policy says (see ``policies/prefetch.py``), then ends the
prefetch and uses what has been published. Ending (``cancel()``) frees the host pages reserved and
not yet published; pages already published stay in the cache. The prefetch holds a pin on the
deepest node it has published (or on the node it continues), so its prefix cannot be evicted under
it.

Storage tiers may be detached at runtime: a probe reads the tiers attached when it starts, a
prefetch started from a probe of a tier detached since stops where that tier's pages begin (a
shorter chain, never an error), and ``using(tier)`` tells a detach which prefetches still read it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from ..keys import TOKEN_BYTES, TokenBytes, chain_keys
from ..policies.prefetch import PrefetchPolicy
from ..radix_tree import HiRadixTree, MatchResult, Pin, TreeNode
from ..stats import Counters
from ..tiers.storage.tier import StorageTier
from .jobs import JobTracker

__all__ = ["Prefetch", "Prefetcher", "StorageHit", "StorageRest"]

_PIPELINE_BATCHES = 4  # batches reserved and fetched per step: the next is read while one is verified


@dataclass(frozen=True)
class StorageHit:
    """Pages after the memory-resident prefix that storage holds, tier by tier."""

    first_page: int
    keys: list[bytes]
    segments: list[tuple[StorageTier, int, int]]  # (tier, first index into keys, pages)
    page_size: int

    @property
    def tokens(self) -> int:
        return len(self.keys) * self.page_size

    def by_tier(self) -> dict[str, int]:
        return {tier.name: n * self.page_size for tier, _, n in self.segments}

    def thin(self) -> list[tuple[int, int]]:
        """Page ranges (of the query) that would come back without their sliding layers."""
        return [
            (self.first_page + s, self.first_page + s + n - tier.window_pages)
            for tier, s, n in self.segments
            if tier.window_pages and n > tier.window_pages
        ]


@dataclass(frozen=True)
class StorageRest:
    """What a retrieve's prefetch left in storage because the host had no room for it: the pages
    up to ``end_page`` (of the query) are there, and the policy's wait for them runs ``until``."""

    end_page: int
    until: float


@dataclass(eq=False)
class Prefetch:
    """A running prefetch, shared by every request that needs its pages.

    ``await wait()`` returns once it has finished (or after ``timeout`` seconds); ``cancel()`` ends
    it (idempotent): pages already published stay cached, pages reserved for the rest are freed.
    """

    tokens_bytes: TokenBytes = field(repr=False)
    first_page: int
    keys: list[bytes] = field(repr=False)
    segments: list[tuple[StorageTier, int, int]] = field(repr=False)
    page_size: int
    created: float
    arrived_pages: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    cancelled: bool = False
    #: It stopped because the host had no room left (every page there pinned, its own ones too):
    #: a retrieve can take what arrived to the device, which makes room, and fetch the rest then.
    out_of_room: bool = False
    _scope: anyio.CancelScope = field(default_factory=anyio.CancelScope, repr=False)
    _done: anyio.Event = field(default_factory=anyio.Event, repr=False)
    _pin: Pin | None = field(default=None, repr=False)
    #: Retrieves waiting for it: when it ends first, its pin stays until the last of them has
    #: woken up and pinned what arrived (else the host could drop those pages in between).
    _waiters: int = field(default=0, repr=False)

    @property
    def tokens(self) -> int:
        """Tokens this prefetch set out to bring (whole pages)."""
        return len(self.keys) * self.page_size

    @property
    def arrived_tokens(self) -> int:
        return self.arrived_pages * self.page_size

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self, timeout: float | None = None) -> int:
        """Wait until finished, or at most ``timeout`` seconds; return the tokens arrived so far."""
        if timeout is None or math.isinf(timeout):
            await self._done.wait()
        elif timeout > 0:
            with anyio.move_on_after(timeout):
                await self._done.wait()
        return self.arrived_tokens

    def cancel(self) -> None:
        """End the prefetch; pages not yet published are freed, published pages stay."""
        if not self._done.is_set():
            self.cancelled = True
            self._scope.cancel()


class Prefetcher:
    """Starts, shares and runs prefetches (owned by the controller, run in its task group)."""

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        tiers: list[StorageTier],
        policy: PrefetchPolicy,
        threshold_tokens: int,
        max_concurrent: int,
        alloc_host: Callable[[int], Awaitable[list[int]]],
        free_host: Callable[[list[int]], None],
        insert_host: Callable[..., list[TreeNode]],
        spawn: Callable[[Callable[[], Awaitable[None]]], None],
        check_open: Callable[[], None],
        counters: Counters,
        jobs: JobTracker,
        page_bytes: int,
        pin_room: Callable[[Callable[[], int]], Awaitable[int]] | None = None,
        slack_pages: int = 0,
        shed_host: Callable[[list[int]], None] = lambda pages: None,
        checkpoints: bool = False,
    ) -> None:
        self.tree = tree
        #: A recurrent model: a run read back can end a hit only on a checkpoint (``_checkpoints_in``).
        self.checkpoints = checkpoints
        self.shed_host = shed_host  # a compact host gives back the memory of pages that came back thin
        # A layer-split tier keeps sliding parts for ``slack_pages`` more before a window: read
        # those that are there, so a prompt branching off a little before the end is a hit too.
        self.slack_pages = slack_pages
        self.tiers = tiers
        self.policy = policy
        self.threshold_tokens = threshold_tokens
        self.limiter = anyio.CapacityLimiter(max_concurrent)
        self.alloc_host = alloc_host
        self.free_host = free_host
        self.insert_host = insert_host
        self.spawn = spawn
        self.check_open = check_open
        self.counters = counters
        self.jobs = jobs
        self.page_bytes = page_bytes
        self.page_size = tree.page_size
        self.running: dict[bytes, Prefetch] = {}  # by the key of every page it fetches
        # Host pages pins may still take (Evictor.wait_pin_room): what a prefetch pins is bounded
        # so that the host keeps room for pages leaving the device.
        self.pin_room = pin_room
        self.reserved = 0  # host pages prefetches are reserving or fetching into (not yet released)

    # -- probing --------------------------------------------------------------------------------

    def _seed(self, match: MatchResult) -> bytes:
        """The key before the first page not in memory (the chain continues from it)."""
        if match.pages == 0:
            return self.tree.seed
        return match.path[-1].keys[match.last_pages - 1]

    async def probe(self, tb: TokenBytes, match: MatchResult) -> StorageHit | None:
        """Ask the tiers, in order, for the pages after ``match``; ``None`` if there are none."""
        pb = self.page_size * TOKEN_BYTES
        full = len(tb) // pb
        if not self.tiers or match.pages >= full:
            return None
        keys = chain_keys(self._seed(match), tb[match.pages * pb : full * pb], self.page_size)
        segments: list[tuple[StorageTier, int, int]] = []
        pos = 0
        for tier in list(self.tiers):  # a snapshot: attach/detach may change the list while we await
            if pos == len(keys):
                break
            if tier.detached:
                continue  # detached meanwhile: the next tier continues where the last one stopped
            n = await tier.exists(keys[pos:])
            if n:
                segments.append((tier, pos, n))
                pos += n
        if not pos:
            return None
        return StorageHit(match.pages, keys[:pos], segments, self.page_size)

    def worth_it(self, hit: StorageHit | None) -> bool:
        return hit is not None and hit.tokens >= max(self.threshold_tokens, 1)

    async def lookup(
        self, tb: TokenBytes, match: MatchResult, *, start: bool, needed: bool = False
    ) -> tuple[StorageHit | None, Prefetch | None]:
        """Probe the tiers after ``match`` and, if ``start`` and worth it, start (or join) a prefetch.

        ``needed``: a retrieve wants the pages now, so any amount is worth fetching (the threshold
        only keeps ``lookup`` from starting background work for a few pages).
        The last node of ``match`` is pinned while the probe awaits, so the prefetch's anchor stays.
        """
        if not self.tiers:
            return None, None
        anchor = match.path[-1] if match.path else None
        pin = Pin(anchor) if anchor is not None else None
        try:
            hit = await self.probe(tb, match)
            if hit is None or not (start and (needed or self.worth_it(hit))):
                return hit, None
            return hit, self.start(tb, hit, anchor)
        finally:
            if pin is not None:
                pin.release()

    # -- starting -------------------------------------------------------------------------------

    def start(self, tb: TokenBytes, hit: StorageHit, anchor: TreeNode | None) -> Prefetch:
        """Start fetching ``hit`` (or join the prefetch already fetching it).

        ``anchor`` is the node holding the page just before ``hit`` (pinned by the caller).
        """
        running = self.running.get(hit.keys[0])
        if running is not None and not running.cancelled:
            return running
        self.check_open()  # the probe awaited: the cache may be closing (no new tasks then)
        hit = self._attached_part(hit)
        pb = self.page_size * TOKEN_BYTES
        op = Prefetch(
            tokens_bytes=tb[: (hit.first_page + len(hit.keys)) * pb],
            first_page=hit.first_page,
            keys=hit.keys,
            segments=hit.segments,
            page_size=self.page_size,
            created=anyio.current_time(),
            _pin=Pin(anchor) if anchor is not None else None,
        )
        for k in hit.keys:
            self.running[k] = op  # a later request may need it from any page on (some arrived)
        self.jobs.add()
        self.counters.prefetches += 1
        try:
            self.spawn(lambda: self._run(op))
        except BaseException:
            self._finish(op)
            raise
        return op

    def _attached_part(self, hit: StorageHit) -> StorageHit:
        """``hit`` up to the first segment of a tier detached since the probe (keys are chained)."""
        for i, (tier, start, _) in enumerate(hit.segments):
            if tier.detached or not any(t is tier for t in self.tiers):
                return StorageHit(hit.first_page, hit.keys[:start], hit.segments[:i], hit.page_size)
        return hit

    def using(self, tier: StorageTier) -> list[Prefetch]:
        """The prefetches still to finish that read (or will read) from ``tier``."""
        ops = {id(op): op for op in list(self.running.values())}.values()
        return [op for op in ops if not op.done and any(t is tier for t, _, _ in op.segments)]

    async def before_retrieve(self, tb: TokenBytes, rest: StorageRest | None = None) -> StorageRest | None:
        """Let storage pages of ``tb`` arrive as the policy allows, then end their prefetch.

        Returns ``None``, or, when the prefetch stopped for want of host room before the policy's
        wait was over (a host tier smaller than the prefix, or one that other requests' pins fill),
        what it left in storage: the retrieve loads what arrived to the device and calls again
        with it as ``rest``, so the rest comes up run by run through the host within the policy's
        one wait.
        """
        if not self.tiers:
            return None
        match = self.tree.match(tb)
        pb = self.page_size * TOKEN_BYTES
        full = len(tb) // pb
        if match.pages >= full:
            return None
        first_key = chain_keys(self._seed(match), tb[match.pages * pb : (match.pages + 1) * pb], self.page_size)[0]
        op = self.running.get(first_key)
        if op is None:
            if self.policy.wait_s(self.threshold_tokens) <= 0:
                return None  # best effort: only what a lookup already started can help
            _, op = await self.lookup(tb, match, start=True, needed=True)
            if op is None:
                return None
        started = anyio.current_time()
        until = op.created + self.policy.wait_s(op.tokens)
        if rest is not None:
            until = min(until, rest.until)
        op._waiters += 1
        try:
            await op.wait(None if math.isinf(until) else until - anyio.current_time())
        finally:
            op.cancel()
            op._waiters -= 1
            if op.done and not op._waiters:
                # The retrieve pins the pages that arrived before it next awaits: hand them over.
                self._release_pin(op)
            self.counters.latency["prefetch_wait"].observe(anyio.current_time() - started)
        if op.out_of_room and anyio.current_time() < until:
            end = min(op.first_page + len(op.keys), full)
            if op.tokens_bytes[: end * pb] != tb[: end * pb]:
                end = match.pages  # joined another query's prefetch: claim nothing past what we share
            return StorageRest(end, until)
        return None

    def cancel_all(self) -> None:
        for op in {id(op): op for op in self.running.values()}.values():
            op.cancel()

    # -- running --------------------------------------------------------------------------------

    async def _run(self, op: Prefetch) -> None:
        try:
            with op._scope:
                async with self.limiter:
                    for tier, start, count in op.segments:
                        pos, end = start, start + count
                        while pos < end:
                            got, go_on = await self._fetch_some(op, tier, pos, end)
                            if not go_on:
                                return
                            pos += got
        finally:
            self._finish(op)

    async def _fetch_some(self, op: Prefetch, tier: StorageTier, pos: int, end: int) -> tuple[int, bool]:
        """Fetch a few batches from key ``pos`` (pipelined), publishing each as it is verified.

        Host pages are reserved for all of them up front; whatever is not published (a short
        read, a cancellation) is freed here. Returns ``(pages fetched, whether to go on)``.
        """
        want = min(tier.batch_pages * _PIPELINE_BATCHES, end - pos, await self._pin_room())
        self.reserved += max(want, 0)  # before the await: a concurrent prefetch sees it taken
        try:
            pages = await self.alloc_host(want) if want > 0 else []
        finally:
            self.reserved -= max(want, 0)
        if not pages:
            op.out_of_room = True  # the host is full of pinned pages (maybe the ones it brought)
            return 0, False
        # A layer-split tier keeps sliding layers for the last pages of what it holds only: the
        # pages of this segment before those come back thin (``TreeNode.thin``).
        start = self._segment_start(op, tier, pos)
        thin_end = max(start, end - tier.window_pages) if tier.window_pages else 0
        self.reserved += len(pages)
        at: list[int] = []  # a recurrent model: the run's pages whose checkpoints the tier holds
        if self.checkpoints and tier.window_pages:
            try:
                at = await self._checkpoints_in(op, tier, pos, len(pages))
            except BaseException:  # cancelled or failed while probing: the pages go back
                self.reserved -= len(pages)
                self.free_host(pages)
                raise
            if pos + len(pages) < end:
                # A run short of the segment's end (the host's room) stops on its last checkpoint.
                keep = at[-1] - pos + 1 if at else 0
                self.reserved -= len(pages) - keep
                self.free_host(pages[keep:])
                if not keep:
                    op.out_of_room = True  # nothing this run could end a hit on: reading it is no use
                    return 0, False
                pages = pages[:keep]
        published = 0
        attached = True
        whole: set[int] = set()  # pages (of the prompt) read back with their checkpoints

        def on_batch(first: int, good: int) -> bool:
            nonlocal published, attached
            thin = (0, 0) if at else (start, thin_end)
            attached = self._publish(op, tier, pos + first, pages[first : first + good], thin,
                                     whole=frozenset(whole) if self.checkpoints else None)
            published = first + good  # published, or freed by the index as duplicates
            return attached

        try:
            if tier.window_pages and self.slack_pages and not self.checkpoints:
                low = max(start, thin_end - self.slack_pages)
                thin_end = await self._slack_start(op, tier, pos, len(pages), low, thin_end)
            if at:
                read = await tier.fetch_checkpoints(  # type: ignore[attr-defined]
                    op.keys[pos : pos + len(pages)], pages, [i - pos for i in at], on_batch=on_batch,
                    before_full=lambda good: whole.update(op.first_page + pos + i for i in good),
                )
                got = read
            elif tier.window_pages:
                got = await tier.fetch(
                    op.keys[pos : pos + len(pages)], pages, on_batch=on_batch, sliding_from=thin_end - pos
                )
            else:
                got = await tier.fetch(op.keys[pos : pos + len(pages)], pages, on_batch=on_batch)
        finally:
            self.reserved -= len(pages)  # published (pinned by op, counted as leased) or freed
            self.free_host(pages[published:])
        return got, attached and got == len(pages)

    @staticmethod
    async def _checkpoints_in(op: Prefetch, tier: StorageTier, pos: int, count: int) -> list[int]:
        """A recurrent model: the keys among ``pos..pos+count`` whose checkpoints (state parts)
        the tier holds, in order; each is read back with its page, so a run ends a hit on any."""
        return [i for i in range(pos, pos + count)
                if await tier.sliding_part.exists([op.keys[i]]) == 1]  # type: ignore[attr-defined]

    @staticmethod
    async def _slack_start(op: Prefetch, tier: StorageTier, pos: int, count: int, low: int, thin_end: int) -> int:
        """Where the sliding parts this fetch (keys ``pos..pos+count``) reads may start: before
        ``thin_end`` (the window's first page) as far back as ``low`` while the tier has them."""
        low = max(low, pos)
        if low >= thin_end or thin_end > pos + count:
            return thin_end  # the slack is not in this batch
        return await tier.sliding_present_from(op.keys[low:thin_end], low)  # type: ignore[attr-defined]

    async def _pin_room(self) -> int:
        """Host pages a prefetch may reserve now (what it brings stays pinned until a retrieve
        takes it); waits, bounded, while pins hold all they may."""
        if self.pin_room is None:
            return 1 << 62
        return await self.pin_room(lambda: self.reserved)

    @staticmethod
    def _segment_start(op: Prefetch, tier: StorageTier, pos: int) -> int:
        """The first key index of the segment of ``op`` that ``tier`` serves from ``pos``."""
        return max((s for t, s, n in op.segments if t is tier and s <= pos < s + n), default=pos)

    def _publish(
        self, op: Prefetch, tier: StorageTier, pos: int, pages: list[int], thin: tuple[int, int] = (0, 0),
        *, whole: frozenset[int] | None = None,
    ) -> bool:
        """Insert verified ``pages`` (from key index ``pos``) as host-only nodes. False: stop here.
        ``thin``: key indices whose pages came back without their sliding layers. ``whole``: a
        recurrent model's pages (of the prompt) that came back with their checkpoints; the others
        are thin."""
        got = len(pages)
        if not got:
            return True
        pb = self.page_size * TOKEN_BYTES
        end = op.first_page + pos + got
        prefix = op.tokens_bytes[: end * pb]
        thin_end = op.first_page + thin[1]
        for node in self.insert_host(prefix, op.first_page + pos, pages, whole=whole):  # new nodes, never hit yet
            node.stored = True
            node.source = tier.name
            node.readback_hits = node.hit_count
            if whole is not None:
                if node.thin and node.host is not None:
                    self.shed_host(list(node.host[: node.thin]))  # zeros already: give their memory back
            elif thin_end > op.first_page + thin[0]:
                first = sum(n.num_pages for n in self.tree.path_to(node.parent))
                node.thin = min(node.num_pages, max(0, thin_end - first))
                if node.thin and node.host is not None:
                    self.shed_host(list(node.host[: node.thin]))  # zeros already: give their memory back
        match = self.tree.match(prefix)
        if match.pages < end:
            return False  # the pages before ours left the cache: ours could not be attached
        if op._pin is not None:
            op._pin.release()
        op._pin = Pin(match.path[-1])  # keep the chain attached for the next batch
        op.arrived_pages += got
        op.by_tier[tier.name] = op.by_tier.get(tier.name, 0) + got * self.page_size
        self.counters.prefetched_pages += got
        self.counters.bytes_moved["storage_to_host"] += got * self.page_bytes
        return True

    @staticmethod
    def _release_pin(op: Prefetch) -> None:
        if op._pin is not None:
            op._pin.release()
            op._pin = None

    def _finish(self, op: Prefetch) -> None:
        if not op._waiters:
            self._release_pin(op)
        for k in op.keys:
            if self.running.get(k) is op:
                del self.running[k]
        op._done.set()
        self.jobs.done()
