"""Prefill/decode hand-offs on the worker's loop: a producer's prompts made durable, a consumer's
awaited and copied into vLLM's blocks. Every wait is bounded; every outcome is counted.

**Producer** (``kv_producer``, ``kv_both``). When a request that asked for a remote decode
finishes, the scheduler sends ``handoff`` with the prompt's tokens. The worker waits for the steps
vLLM ended before (their pages committed), answers how many leading tokens the cache holds and a
``check`` (a MAC keyed by the last page's key, which names namespace, tenant, page size and
tokens, over the hand-off's id and pulse period: ``page_check``), and
starts making them durable in the shared tier (``HiCache.persist``; a write the tier refuses is
tried again, backing off, until shortly before the bound). The scheduler returns those
in ``kv_transfer_params`` and keeps the request's blocks; the request is reported finished-sending
(vLLM frees them) when the tier holds the pages, or after ``send_timeout_s``, counted as failed.
A producer that gives up (the bound passed, the tier refused the pages, the host had no room for
them) says so: it stores a marker in the shared tier (``notice_key``: the hand-off's id, which the
scheduler chose and the parameters carry, over the last page's key, so only this namespace's
consumer of this hand-off can name it), and the consumer stops waiting for pages that will not come.
A producer that cannot say so (killed, or cut off from the tier) falls silent: while a send is in
flight it leaves a pulse in the shared tier every ``PULSE_S`` (``pulse_key``: the marker's name and
the beat's number), and a consumer that sees ``SILENT_BEATS`` periods pass without the pulse due,
twice in a row (a failed read looks like silence once), stops waiting as if it had read the
marker, long before its ``receive_timeout_s``. No clocks are
compared: the consumer counts from when it accepted the request, which is after the hand-off
began, so every pulse it asks for was due on the producer's side earlier still.
The blocks are not read after the request's last step (its pages were copied into host pages
during the forward): holding them is what bounds the memory of hand-offs still in flight.

**Consumer** (``kv_consumer``, ``kv_both``). The request arrives with those parameters. Its queued
lookup carries them (``expect``): the worker compares the check with its own for the same tokens,
id and period (a consumer of other weights, another tenant or another page size differs and is
refused at once, counted: vLLM computes the prompt; with a tenant key, so are parameters a client
forged or altered, since only holders of the key can make a check), then watches for the pages
while the request waits, asking the cache (a lookup with prefetch: storage pages come up into the
host tier as they appear) until they are all there, the producer's marker says it gave up (what
the tier holds then is all that comes: counted, ``pd_receives_given_up``), or ``receive_timeout_s``
has passed. Once vLLM has given the request blocks (``begin``, from the step's metadata), the
pages are held where they lie and copied into those blocks in a cache thread, off vLLM's thread,
and the request is reported received; pages the tier listed but whose read came up short (a
transfer that failed or timed out) are read again
while the receive's time lasts (counted: ``pd_receive_retries``). What did not
arrive in time is reported as failed blocks in the same step, and vLLM recomputes it
(``kv_load_failure_policy="recompute"``). A request aborted meanwhile ends its receive at once.

Nothing of the producer's block layout crosses: the consumer finds the pages by its own keys
(namespace and tokens), and every page it reads is verified as any storage read is.

Results reach vLLM's thread through ``take`` (a lock; vLLM's ``get_finished``). A send is reported
only once vLLM has told the worker the request finished (``get_finished``'s contract).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ...errors import HiCacheError
from ...keys import as_token_bytes, chain_keys
from .settings import PDOptions

if TYPE_CHECKING:
    from ...cache import HiCache
    from ...config import HiCacheConfig
    from .metadata import ReceiveSpec

__all__ = ["Handoffs", "CopyIn", "ReceiveOutcome", "PULSE_S", "SILENT_BEATS"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

_POLL_S = (0.002, 0.004, 0.008, 0.016, 0.032, 0.05)  # how often a consumer asks again while pages are on their way
_REREAD_S = (0.05, 0.1, 0.2, 0.5)  # the pause before a consumer reads again pages whose read came up short
_COMMIT_WAIT_S = 2.0  # how long a hand-off waits for the steps vLLM ended before it
_FORGOTTEN = 10_000  # finished requests remembered, in case their blocks come after
_NOTICE_EVERY_S = 0.1  # how often a waiting consumer asks the tier for its producer's gave-up marker
_NOTICE_BOUND_S = 1.0  # the most a producer spends storing that marker
PULSE_S = 1.0  # how often a producer with a send in flight leaves a pulse in the shared tier
SILENT_BEATS = 3  # pulse periods a consumer lets pass without the one due before it stops waiting
_PULSE_RANGE_S = (0.01, 60.0)  # the pulse periods a consumer takes from a producer's parameters

#: ``copy_in(block_ids, first_page, segments, thin)``: copy held pages (``[(tier, pages)]``, from token
#: page ``first_page`` on) into the request's vLLM blocks (per KV cache group), every layer (run in a
#: cache thread); the pages copied (fewer where pages held ``thin`` would land in blocks vLLM keeps).
CopyIn = Callable[[tuple[list[int], ...], int, list[tuple[Any, list[int]]], tuple[tuple[int, int], ...]], int]


@dataclasses.dataclass
class ReceiveOutcome:
    """A finished receive, for vLLM's thread: pages ``from_page..spec.end_page`` did not arrive."""

    spec: ReceiveSpec
    from_page: int


@dataclasses.dataclass(eq=False)
class _Receive:
    req_id: str
    tokens: list[int]  # the prefix to receive (whole vLLM blocks)
    deadline: float  # anyio clock
    started: float  # perf_counter, for the wait's duration
    arrived: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    watching: anyio.CancelScope = dataclasses.field(default_factory=anyio.CancelScope)
    copying: anyio.CancelScope = dataclasses.field(default_factory=anyio.CancelScope)
    spec: ReceiveSpec | None = None
    cancelled: bool = False
    notice: bytes | None = None  # the producer's gave-up marker, where its hand-off named one
    pulse_s: float | None = None  # the producer's pulse period, where it said it pulses
    limit_page: int | None = None  # the producer gave up: pages past this will not come

    def cancel(self) -> None:
        self.cancelled = True
        self.watching.cancel()
        self.copying.cancel()


def page_check(seed: bytes, tokens: list[int], page_size: int, handoff_id: Any = None, pulse_s: Any = None) -> str:
    """The digest a producer and a consumer compare: a MAC, keyed by the last full page's key (which
    chains the namespace, the tenant and every token before it), of the hand-off's id and pulse
    period. It reveals no key. With a tenant key the chain's seed is secret, so nobody without the
    key can make a check, nor change the tokens, the id or the period a real one was made for (a
    consumer refuses such parameters); without one the seed follows from public facts (the model,
    its weights, the geometry), and anyone who knows them can (``docs/engines/pd.md``)."""
    keys = chain_keys(seed, as_token_bytes(tokens), page_size)
    if not keys:
        return ""
    ident = handoff_id if isinstance(handoff_id, str) else ""
    pulse = repr(float(pulse_s)) if isinstance(pulse_s, int | float) and not isinstance(pulse_s, bool) else ""
    return hashlib.blake2b(f"{ident}\0{pulse}".encode(), key=keys[-1], digest_size=16,
                           person=b"hicache-pd-check").hexdigest()


def notice_key(seed: bytes, tokens: list[int], page_size: int, handoff_id: str) -> bytes | None:
    """The page-key-like name of a hand-off's gave-up marker: its id over the last full page's key
    (secret to the namespace and tenant, as every page key is), so another tenant can neither
    name nor forge it, and two hand-offs of the same prompt have their own."""
    keys = chain_keys(seed, as_token_bytes(tokens), page_size)
    if not keys or not handoff_id:
        return None
    return hashlib.blake2b(keys[-1] + handoff_id.encode(), digest_size=16, person=b"hicache-pd-quit").digest()


def pulse_key(notice: bytes, beat: int) -> bytes:
    """The name of a hand-off's ``beat``-th pulse (``beat`` >= 1): over its gave-up marker's name,
    so as secret to the namespace, the tenant and the hand-off."""
    return hashlib.blake2b(notice + beat.to_bytes(8, "big"), digest_size=16, person=b"hicache-pd-beat").digest()


class HandoffHost(Protocol):
    """What ``Handoffs`` uses of the worker's ``CacheService`` (``service.py``, which owns it)."""

    config: HiCacheConfig
    counters: Any  # ConnectorCounters: the pd_* fields

    @property
    def _cache(self) -> HiCache: ...

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None: ...

    async def wait_for_ended_steps(self, timeout_s: float) -> Any: ...

    def record_loads(self, loads: list[tuple[str, int, dict[str, int], int]]) -> None: ...


class Handoffs:
    """The worker's hand-offs (see the module docstring); owned by the ``CacheService``."""

    def __init__(self, service: HandoffHost, options: PDOptions) -> None:
        self.service = service
        self.options = options
        self._receives: dict[str, _Receive] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()  # finished requests, in case their blocks come after
        self._sends = 0  # in flight
        # Shared with vLLM's thread (``take``), under the lock:
        self._lock = threading.Lock()
        self._sending: set[str] = set()  # hand-offs not yet durable (or timed out)
        self._sent: set[str] = set()  # done, not yet reported
        self._finished: set[str] = set()  # vLLM said finished, the send not done yet
        self._received: list[ReceiveOutcome] = []
        self._ready = threading.Event()  # set when a send or receive is done, for a waiting ``take``

    @property
    def _cache(self) -> Any:
        return self.service._cache

    def _check(self, tokens: list[int], handoff_id: Any, pulse_s: Any) -> str:
        cache = self._cache
        return page_check(cache.controller.tree.seed, tokens, cache.page_size, handoff_id, pulse_s)

    def _notice_key(self, tokens: list[int], handoff_id: Any) -> bytes | None:
        """The marker's name, or None for a missing or malformed id (the receive bound alone ends it)."""
        if not isinstance(handoff_id, str) or not 0 < len(handoff_id) <= 64:
            return None
        cache = self._cache
        return notice_key(cache.controller.tree.seed, tokens, cache.page_size, handoff_id)

    def _shared_tier(self) -> Any:
        """The storage tier hand-offs cross (``pd.tier``, else the first that takes writes); None if none."""
        try:
            return self._cache._storage_tier(self.options.tier)
        except HiCacheError:
            return None

    # -- producer -------------------------------------------------------------------------------

    async def handoff(self, req_id: str, tokens: list[int], handoff_id: str | None = None) -> dict[str, Any]:
        """A finished prefill: the tokens hicache holds of ``tokens`` (whole pages), and their check;
        making them durable in the shared tier starts now (reported sent when done). ``handoff_id``:
        the name of the marker left if that fails (the scheduler passes it to the consumer)."""
        cache = self._cache
        ps = cache.page_size
        await self.service.wait_for_ended_steps(_COMMIT_WAIT_S)
        hit = await cache.lookup(tokens, prefetch=False)
        n = min(hit.tokens, len(tokens) // ps * ps)
        if n <= 0:
            self.service.counters.pd_send_failures += 1
            return {"tokens": 0}
        with self._lock:
            self._sending.add(req_id)
        self._sends += 1
        notice = self._notice_key(tokens[:n], handoff_id)
        self.service.spawn(self._send, req_id, tokens[:n], notice, anyio.current_time())
        # The consumer may stop waiting when the pulses stop; the check covers the period and the id.
        pulse = PULSE_S if notice is not None and self._shared_tier() is not None else None
        reply: dict[str, Any] = {"tokens": n, "check": self._check(tokens[:n], handoff_id, pulse)}
        if pulse is not None:
            reply["pulse_s"] = pulse
        return reply

    async def _send(self, req_id: str, tokens: list[int], notice: bytes | None, begun: float) -> None:
        c = self.service.counters
        started = time.perf_counter()
        durable = 0
        beats: list[int] = []  # the pulses left (or being left) in the shared tier
        stop, pulsed = anyio.Event(), anyio.Event()
        if notice is not None:
            self.service.spawn(self._pulse, notice, begun, beats, stop, pulsed)
        else:
            pulsed.set()
        try:
            bound = self.options.send_timeout_s
            with anyio.move_on_after(bound):  # failed writes are tried again until shortly before it
                durable = await self._cache.persist(tokens, tier=self.options.tier, retry_s=bound * 0.9)
        except HiCacheError as exc:
            log.warning("hicache: hand-off of %s failed: %r", req_id, exc)
        finally:
            self._sends -= 1
            elapsed = time.perf_counter() - started
            c.pd_send_s += elapsed
            if durable >= len(tokens):
                c.pd_sends += 1
                c.pd_sent_tokens += durable
            else:
                c.pd_send_failures += 1
                log.warning(
                    "hicache: hand-off of %s: %d of %d tokens durable in %s after %.1f s; the decode side "
                    "recomputes the rest", req_id, durable, len(tokens), self.options.tier or "the shared tier", elapsed,
                )
            with self._lock:
                self._sending.discard(req_id)
                self._sent.add(req_id)
            self._ready.set()
            stop.set()
            if notice is not None:
                # Shielded and bounded: a producer that gives up because it is closing says so too.
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(_NOTICE_BOUND_S):
                        await pulsed.wait()  # a pulse being written lands before the pulses are removed
                    if durable < len(tokens):
                        with anyio.move_on_after(_NOTICE_BOUND_S):
                            await self._tell_gave_up(req_id, notice)
                    if beats:  # the marker (or the pages) now speak for the producer
                        with anyio.move_on_after(_NOTICE_BOUND_S):
                            await self._stop_pulse(notice, beats)

    async def _pulse(self, notice: bytes, started: float, beats: list[int], stop: anyio.Event,
                     pulsed: anyio.Event) -> None:
        """Leave pulse 1, 2, ... of a send in the shared tier, pulse ``k`` at ``k * PULSE_S`` after
        ``started`` (anyio clock, when the hand-off was answered), until ``stop``. A pulse written
        late (a slow tier) skips to the next one due, so a backlog never builds; a pulse is never
        cut off mid-write, it is waited for instead."""
        try:
            tier = self._shared_tier()
            while tier is not None:
                beat = int((anyio.current_time() - started) / PULSE_S) + 1
                with anyio.move_on_at(started + beat * PULSE_S):
                    await stop.wait()
                if stop.is_set():
                    return
                beats.append(beat)
                try:
                    await tier.mark(pulse_key(notice, beat))
                except HiCacheError:
                    pass  # a tier that refuses writes: the consumer hears silence, as it should
        finally:
            pulsed.set()

    async def _stop_pulse(self, notice: bytes, beats: list[int]) -> None:
        tier = self._shared_tier()
        if tier is None:
            return
        for beat in beats:
            try:
                await tier.unmark(pulse_key(notice, beat))
            except HiCacheError:
                return  # the tier's own eviction takes what is left

    async def _tell_gave_up(self, req_id: str, notice: bytes) -> None:
        tier = self._shared_tier()
        try:
            told = tier is not None and await tier.mark(notice)
        except HiCacheError:
            told = False
        if told:
            self.service.counters.pd_gave_up_notices += 1
        else:
            log.info("hicache: %s: could not leave the gave-up marker; the decode side waits its receive_timeout_s",
                     req_id)

    # -- consumer -------------------------------------------------------------------------------

    def expect(self, req_id: str, tokens: list[int], receive_tokens: int, checks: Any, rank: int,
               handoff_id: Any = None, pulse_s: Any = None) -> bool:
        """A queued request that a producer prefilled: accept it (its check matches ours) and watch
        for its first ``receive_tokens`` tokens, or refuse it (counted). ``handoff_id``: where the
        producer leaves word that it gave up; ``pulse_s``: how often it leaves a pulse while it
        sends (older producers send neither: the bound alone ends the wait)."""
        c = self.service.counters
        mine = self._check(tokens, handoff_id, pulse_s)
        theirs = checks[rank] if isinstance(checks, list) and 0 <= rank < len(checks) else None
        tp = self.service.config.parallel.tp_size
        if (not mine or not isinstance(theirs, str) or len(checks) != tp
                or not hmac.compare_digest(theirs.encode(), mine.encode())):
            c.pd_receives_refused += 1
            log.info("hicache: %s: the hand-off's parameters are not this namespace's (other weights, tenant, page "
                     "size or tokens), or were altered or forged; vLLM computes the prompt", req_id)
            return False
        self._end(req_id)  # a request id seen again (a retry): start over
        low, high = _PULSE_RANGE_S
        pulse = float(pulse_s) if isinstance(pulse_s, int | float) and not isinstance(pulse_s, bool) else None
        rec = _Receive(req_id, tokens[:receive_tokens], anyio.current_time() + self.options.receive_timeout_s,
                       time.perf_counter(), notice=self._notice_key(tokens, handoff_id),
                       pulse_s=pulse if pulse is not None and low <= pulse <= high else None)
        self._receives[req_id] = rec
        self.service.spawn(self._await_arrival, rec)
        return True

    async def _await_arrival(self, rec: _Receive) -> None:
        """Ask the cache until the pages are all in memory or in a storage tier (a lookup with
        prefetch brings them up), the producer's marker says no more will come, its pulse has
        stopped, or the receive's time is up."""
        cache = self._cache
        want = len(rec.tokens)
        tier = self._shared_tier() if rec.notice is not None else None
        accepted = anyio.current_time()  # after the hand-off began: every pulse asked for was due before
        next_notice = accepted + _NOTICE_EVERY_S
        asked = 0  # the last pulse asked for
        missed = 0  # pulses in a row not heard: one may be a failed read (``exists`` says 0), two are silence
        i = 0
        try:
            with rec.watching:
                with anyio.move_on_at(rec.deadline):
                    while True:
                        hit = await cache.lookup(rec.tokens, prefetch=True)
                        if hit.tokens >= want:
                            return
                        if tier is not None and anyio.current_time() >= next_notice:
                            next_notice = anyio.current_time() + _NOTICE_EVERY_S
                            if await tier.has_mark(rec.notice):
                                await self._given_up(rec, tier)
                                return
                            if rec.pulse_s is not None:
                                due = int((anyio.current_time() - accepted) / rec.pulse_s) - SILENT_BEATS
                                if due > asked:
                                    asked = due
                                    missed = 0 if await self._heard(tier, rec.notice, due) else missed + 1
                                    if missed >= 2:
                                        await self._given_up(rec, tier, silent=True)
                                        return
                        await anyio.sleep(_POLL_S[min(i, len(_POLL_S) - 1)])
                        i += 1
        except HiCacheError as exc:
            log.warning("hicache: waiting for the KV of %s failed: %r", rec.req_id, exc)
        finally:
            rec.arrived.set()

    @staticmethod
    async def _heard(tier: Any, notice: bytes, due: int) -> bool:
        """Whether the producer left pulse ``due`` or one of the next ``SILENT_BEATS`` (a late
        pulse skips ahead; the pulses stay until the send ends)."""
        for beat in range(due, due + SILENT_BEATS + 1):
            if await tier.has_mark(pulse_key(notice, beat)):
                return True
        return False

    async def _given_up(self, rec: _Receive, tier: Any, *, silent: bool = False) -> None:
        """The producer gave up (its marker is stored after its last write) or fell ``silent`` (no
        pulse for ``SILENT_BEATS`` periods, twice: killed, or cut off from the tier): what the tiers hold
        now is all that comes, and the receive copies that much."""
        hit = await self._cache.lookup(rec.tokens, prefetch=True)
        assert rec.notice is not None
        if not silent:
            await tier.unmark(rec.notice)
        if hit.tokens >= len(rec.tokens):
            return  # they all came after all (a send that ended just now stops pulsing)
        rec.limit_page = hit.tokens // self._cache.page_size
        if silent:
            self.service.counters.pd_receives_producer_silent += 1
            log.info("hicache: %s: the prefill server fell silent (no pulse for %.1f s); %d of %d tokens arrived, "
                     "vLLM recomputes the rest", rec.req_id, (SILENT_BEATS + 2) * (rec.pulse_s or 0), hit.tokens,
                     len(rec.tokens))
            return
        self.service.counters.pd_receives_given_up += 1
        log.info("hicache: %s: the prefill server gave up its hand-off; %d of %d tokens arrived, vLLM recomputes "
                 "the rest", rec.req_id, hit.tokens, len(rec.tokens))

    def begin(self, spec: ReceiveSpec, copy_in: CopyIn) -> None:
        """vLLM gave the request its blocks (the step's metadata): copy the pages in when they are here."""
        if spec.req_id in self._forgotten:  # finished or aborted before its blocks were given: nothing to copy
            self._forgotten.pop(spec.req_id)
            self.service.counters.pd_receive_failures += 1
            with self._lock:
                self._received.append(ReceiveOutcome(spec, spec.first_page))
            self._ready.set()
            return
        rec = self._receives.get(spec.req_id)
        if rec is None:  # its queued lookup went unanswered: wait for the pages from now
            rec = _Receive(spec.req_id, spec.tokens, anyio.current_time() + self.options.receive_timeout_s,
                           time.perf_counter())
            self._receives[spec.req_id] = rec
            self.service.spawn(self._await_arrival, rec)
        rec.spec = spec
        self.service.spawn(self._receive, rec, copy_in)

    async def _receive(self, rec: _Receive, copy_in: CopyIn) -> None:
        spec = rec.spec
        assert spec is not None
        cache = self._cache
        ps = cache.page_size
        c = self.service.counters
        pos = spec.first_page
        rereads = 0
        by_tier: dict[str, int] = {}
        try:
            with rec.copying:
                with anyio.move_on_at(rec.deadline):
                    await rec.arrived.wait()
                async with AsyncExitStack() as stack:
                    with anyio.move_on_at(max(rec.deadline, anyio.current_time() + 0.5)):
                        end = spec.end_page if rec.limit_page is None else min(spec.end_page, rec.limit_page)
                        while pos < end and not rec.cancelled:
                            held = await stack.enter_async_context(cache.hold(spec.tokens, start=pos * ps))
                            got = min(held.tokens // ps, end)
                            if got <= pos:
                                # Seen in storage but not read into memory: the read failed or
                                # was cut (a store's transfer timed out, the host had no room).
                                # Ask again while the receive's time lasts.
                                pause = _REREAD_S[min(rereads, len(_REREAD_S) - 1)]
                                if anyio.current_time() + pause >= rec.deadline:
                                    break
                                rereads += 1
                                c.pd_receive_retries += 1
                                await anyio.sleep(pause)
                                await cache.lookup(spec.tokens, prefetch=True)
                                continue
                            segments, left = [], got - pos
                            for tier, pages in held.segments:
                                if left > 0 and pages:
                                    segments.append((tier, pages[:left]))
                                    left -= len(pages[:left])
                            started = time.perf_counter()
                            copied = await anyio.to_thread.run_sync(copy_in, spec.block_ids, pos, segments, held.thin)
                            c.pd_copy_s += time.perf_counter() - started
                            if copied < got - pos:  # pages held thin would land in blocks vLLM keeps
                                log.info("hicache: %s: pages from %d on arrived without their sliding layers; vLLM "
                                         "recomputes them", rec.req_id, pos + copied)
                                got = end = pos + copied
                            take = (got - pos) * ps
                            for tier, n in held.by_tier.items():  # the tiers that supplied them, in order
                                share = min(int(n), take)
                                if share > 0:
                                    by_tier[tier] = by_tier.get(tier, 0) + share
                                    take -= share
                            pos = got
        except HiCacheError as exc:
            log.warning("hicache: receiving the KV of %s failed: %r", rec.req_id, exc)
        finally:
            if self._receives.get(rec.req_id) is rec:
                del self._receives[rec.req_id]
            loaded = (pos - spec.first_page) * ps
            missing = (spec.end_page - pos) * ps
            c.pd_receive_wait_s += time.perf_counter() - rec.started
            if missing:
                c.pd_receive_failures += 1
                if not rec.cancelled:
                    log.info("hicache: %s: %d of %d tokens from the prefill server arrived in %.1f s (bound %.1f s); "
                             "vLLM recomputes the rest", rec.req_id, loaded, loaded + missing,
                             time.perf_counter() - rec.started, self.options.receive_timeout_s)
            else:
                c.pd_receives += 1
            c.pd_received_tokens += loaded
            self.service.record_loads([(rec.req_id, loaded, by_tier, missing)])
            with self._lock:
                self._received.append(ReceiveOutcome(spec, pos))
            self._ready.set()

    def forget(self, req_id: str, *, finished: bool = True) -> None:
        """The request finished or was aborted (``finished``), or vLLM holds its prefix itself: end its receive."""
        self._end(req_id)
        if finished:
            self._forgotten[req_id] = None
            while len(self._forgotten) > _FORGOTTEN:
                self._forgotten.popitem(last=False)

    def _end(self, req_id: str) -> None:
        rec = self._receives.pop(req_id, None)
        if rec is not None:
            rec.cancel()

    # -- for vLLM's thread ------------------------------------------------------------------------

    def take(self, finished_req_ids: set[str], wait_s: float = 0.0) -> tuple[set[str], list[ReceiveOutcome]]:
        """Sends done (of requests vLLM has said finished) and receives done since the last call.

        ``wait_s``: with nothing done but hand-offs in flight, wait that long for one to end. vLLM
        steps without a forward while requests only wait for transfers, calling this every few
        hundred microseconds: a short wait here keeps that loop from spinning two cores, and a
        transfer that ends wakes it at once.
        """
        if wait_s > 0 and not self._ready.is_set() and (self._sends or self._receives):
            self._ready.wait(wait_s)
        self._ready.clear()
        with self._lock:
            for rid in finished_req_ids:
                if rid in self._sending or rid in self._sent:
                    self._finished.add(rid)
            sent = self._sent & self._finished
            self._sent -= sent
            self._finished -= sent
            received, self._received = self._received, []
        return sent, received

    @property
    def in_flight(self) -> tuple[int, int]:
        """(hand-offs being made durable, receives waiting or copying)."""
        return self._sends, len(self._receives)
