"""The worker's asynchronous half: the ``HiCache``, the channel server, each step's leases.

It runs on an event loop in a thread of the worker process (an anyio blocking portal); vLLM's
synchronous hooks call into it through the portal. Everything a step holds (the held prefixes it
loads from, the host pages reserved for what it saves) lives in one ``AsyncExitStack`` per step,
closed when the step ends, whatever happened: nothing outlives its step. Prefetches started by the
scheduler's lookups are held per request and cancelled when the request finishes or is aborted.

It also prepares the metrics: every ``stats_interval_s`` a snapshot of hicache's and the
connector's metric families for vLLM's connector stats (``export.py``), and, with a
``metrics_port``, hicache's own ``/metrics`` server on this loop. When it closes, the cache drains
what its write policy owes storage (bounded by ``controller.shutdown_timeout_s``) and the service
logs what was written and what was not, with counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, asynccontextmanager
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import torch
from anyio.abc import SocketStream, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream

from ...cache import HiCache
from ...config import HiCacheConfig
from ...controller.prefetch import Prefetch
from ...errors import HiCacheError
from ...leases import HeldPrefix, SlotReservation
from .channel import MAX_FRAME, encode, unpack_tokens
from .export import connector_families
from .export import encode as encode_families
from .handoff import CopyIn, Handoffs
from .profile import WORKER_HOOKS, HookProfile, thread_cpu_seconds, threads_cpu_seconds
from .settings import ConnectorOptions

if TYPE_CHECKING:
    from .metadata import LoadSpec, ReceiveSpec, SaveSpec

__all__ = ["CacheService", "StepLeases", "ConnectorCounters"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

_RECORDS = 100_000  # per-request load records kept for tools (oldest dropped)
_SETTLE_TIMEOUT_S = 30.0  # how long closing (or a stats call) waits for the steps vLLM ended to finish
_CATCH_UP_S = 0.25  # how long a lookup waits for the steps vLLM ended before it (their saves) to finish


@dataclasses.dataclass
class ConnectorCounters:
    """What the connector did (the cache's own figures are in ``HiCache.stats()``)."""

    lookups: int = 0
    lookup_hit_tokens: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    loaded_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    load_failures: int = 0
    failed_tokens: int = 0
    saves: int = 0
    saved_tokens: int = 0
    save_skipped_pages: int = 0
    prefetches_held: int = 0
    prefetches_cancelled: int = 0
    drained_pages: int = 0  # written to storage while the cache closed
    undrained_pages: int = 0  # promised to storage, not written when it closed (logged with the count)
    # prefill/decode hand-offs (handoff.py): a producer's sends, a consumer's receives
    pd_sends: int = 0  # prompts durable in the shared tier within send_timeout_s
    pd_sent_tokens: int = 0
    pd_send_failures: int = 0  # not (all) durable in time, or nothing to hand off: the decode side recomputes
    pd_gave_up_notices: int = 0  # failed sends whose gave-up marker the shared tier stored (the consumer stops waiting)
    pd_send_s: float = 0.0  # seconds from the hand-off to durable (or given up), summed
    pd_receives: int = 0  # every promised page arrived and was copied into vLLM's blocks
    pd_received_tokens: int = 0
    pd_receive_failures: int = 0  # some pages did not arrive within receive_timeout_s (or the request ended)
    pd_receives_given_up: int = 0  # the producer's marker said it gave up: what had arrived was copied, the rest computed
    pd_receives_producer_silent: int = 0  # the producer's pulse stopped (killed, cut off): the same, without a marker
    pd_receives_refused: int = 0  # the producer's check is not this namespace's: computed here
    pd_receive_retries: int = 0  # reads of listed pages that came up short and were asked again
    pd_receive_wait_s: float = 0.0  # seconds from the queued request to its pages copied (or given up), summed
    pd_copy_s: float = 0.0  # seconds copying received pages into vLLM's blocks (cache threads), summed


@dataclasses.dataclass
class StepLeases:
    """The leases of one vLLM step (held prefixes to load from, reservations to save into)."""

    stack: AsyncExitStack = dataclasses.field(default_factory=AsyncExitStack)
    holds: list[HeldPrefix | _Staged | None] = dataclasses.field(default_factory=list)
    hold_s: float = 0.0  # seconds the holds took (waiting for storage pages to reach the host tier, mostly)
    reservations: list[SlotReservation | None] = dataclasses.field(default_factory=list)


class CacheService(anyio.AsyncContextManagerMixin):
    """Owns the cache and the channel server for one vLLM worker."""

    def __init__(self, config: HiCacheConfig, socket_path: str, options: ConnectorOptions | None = None) -> None:
        self.config = config
        self.socket_path = socket_path
        self.options = options or ConnectorOptions()
        self.cache: HiCache | None = None
        self.counters = ConnectorCounters()
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._held: dict[str, Prefetch] = {}
        self.open_steps = 0
        self.worker_profile = HookProfile(WORKER_HOOKS)  # timed by WorkerSide in vLLM's thread
        self.scheduler_profile: dict[str, list[float]] = {}  # the scheduler's, sent with its messages
        self.payload: tuple[int, list[list[Any]]] | None = None  # (sequence, families) for vLLM's stats
        self.metrics_url: str | None = None
        self.save_tier = "host"
        self.staging_pages = 0  # the device tier's pages: what can stage a step's pages the host cannot take
        self._loop_thread: int | None = None
        # Steps ended by vLLM's thread (schedule_finish) and finished here, in order, by one task:
        # the scheduled count is written by that thread only, the done count by this loop only.
        self.finishes_scheduled = 0
        self.finishes_done = 0
        self._finishes: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._finish_wakeup = anyio.Event()
        self._step_finished = anyio.Event()  # set (and replaced) each time a step has finished
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: TaskGroup | None = None
        self.handoffs = Handoffs(self, self.options.pd)

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[CacheService]:
        self._loop_thread = threading.get_ident()
        threading.current_thread().name = "hicache loop"  # the portal's thread: named for threads_cpu_seconds
        self._loop = asyncio.get_running_loop()
        async with HiCache.from_config(self.config) as cache:
            self.cache = cache
            # Saves go straight into host pages; only a cache without a host tier keeps them on its device tier.
            tiers = cache.stats().tiers
            self.save_tier = "host" if tiers["host"].capacity_pages else "device"
            self.staging_pages = tiers["device"].capacity_pages
            try:
                os.unlink(self.socket_path)  # a stale socket of a dead engine with the same id
            except FileNotFoundError:
                pass
            listener = await anyio.create_unix_listener(self.socket_path)
            try:
                os.chmod(self.socket_path, 0o600)
                async with AsyncExitStack() as stack:
                    if self.options.metrics_port is not None:
                        await self._serve_metrics(stack)
                    async with anyio.create_task_group() as tg:
                        self._tg = tg
                        tg.start_soon(listener.serve, self._serve)
                        tg.start_soon(self._finish_steps)
                        if self.options.stats_interval_s > 0:
                            tg.start_soon(self._prepare_payloads, self.options.stats_interval_s)
                        try:
                            yield self
                        finally:
                            with anyio.CancelScope(shield=True):
                                await self._settle_steps(_SETTLE_TIMEOUT_S)  # the steps vLLM ended, first
                            tg.cancel_scope.cancel()
            finally:
                self._tg = None
                for op in self._held.values():
                    op.cancel()
                self._held.clear()
                await listener.aclose()
                try:
                    os.unlink(self.socket_path)
                except FileNotFoundError:
                    pass
                before = self._drain_state(cache)
                started = time.monotonic()
        self.cache = None
        self._log_drain(cache, before, time.monotonic() - started)

    # -- shutdown accounting --------------------------------------------------------------------

    def _drain_state(self, cache: HiCache) -> dict[str, int]:
        """The storage queue as the cache starts to close, and the counts of pages written and lost so far."""
        try:
            s = cache.stats()
        except Exception as exc:  # noqa: BLE001 - accounting must not stop the close
            log.warning("hicache: drain figures unavailable: %r", exc)
            return {}
        return {
            "queued": sum(s.queue_depths.values()),
            "in_flight": s.in_flight,
            "tiers": len(s.storage),
            "stored": s.storage_backups,
            "lost": s.lost_pages,
        }

    def _log_drain(self, cache: HiCache, before: dict[str, int], seconds: float) -> None:
        """After the cache closed: how many pages its drain wrote to storage, how many it could not."""
        if not before.get("tiers"):
            return  # no storage tier: nothing is owed below memory
        after = self._drain_state(cache)
        if not after:
            return
        written, lost = after["stored"] - before["stored"], after["lost"] - before["lost"]
        self.counters.drained_pages, self.counters.undrained_pages = written, lost
        line = (
            "hicache: closed in %.1f s: %d pages written to storage while draining (%d jobs were queued, %d in "
            "flight), %d pages the %s policy promised to storage not written"
        )
        args = (seconds, written, before["queued"], before["in_flight"], lost, cache.config.policies.write)
        (log.warning if lost else log.info)(line, *args)

    # -- metrics --------------------------------------------------------------------------------

    @property
    def held_prefetches(self) -> int:
        return len(self._held)

    def loop_cpu_seconds(self) -> float | None:
        """CPU seconds of the cache's event-loop thread (channel, commits, background work it runs)."""
        return thread_cpu_seconds(self._loop_thread)

    def profiles(self) -> dict[str, dict[str, list[float]]]:
        return {"scheduler": dict(self.scheduler_profile), "worker": self.worker_profile.snapshot()}

    def export(self) -> list[list[Any]]:
        """hicache's and the connector's metric families, as plain data (``export.encode``)."""
        from ...metrics import HiCacheCollector

        return encode_families([*HiCacheCollector(self._cache).collect(), *connector_families(self)])

    async def _prepare_payloads(self, interval_s: float) -> None:
        """Every ``interval_s``: a fresh export for vLLM's connector stats, which ``get_kv_connector_stats``
        picks up without waiting (vLLM asks every step, on its own thread)."""
        seq = 0
        while True:
            seq += 1
            self.payload = (seq, self.export())
            await anyio.sleep(interval_s)

    async def _serve_metrics(self, stack: AsyncExitStack) -> None:
        """hicache's ``/metrics`` (and ``/healthz``) on this loop, with the connector's families."""
        from prometheus_client import CollectorRegistry

        from ...metrics import HiCacheCollector, serve

        registry = CollectorRegistry(auto_describe=False)
        registry.register(HiCacheCollector(self._cache))
        registry.register(_ConnectorCollector(self))
        server = await stack.enter_async_context(
            serve(self._cache, port=self.options.metrics_port or 0, host=self.options.metrics_host, registry=registry)
        )
        self.metrics_url = f"{server.url}/metrics"
        log.info("hicache: metrics on %s", self.metrics_url)

    @property
    def _cache(self) -> HiCache:
        assert self.cache is not None, "the service is not open"
        return self.cache

    # -- channel --------------------------------------------------------------------------------

    async def _serve(self, stream: SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            while True:
                try:
                    n = int.from_bytes(await reader.receive_exactly(4), "big")
                    if n > MAX_FRAME:
                        return
                    message = json.loads(await reader.receive_exactly(n))
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ValueError):
                    return
                try:
                    reply = await self.handle(message)
                except (HiCacheError, TimeoutError, LookupError, TypeError, ValueError) as exc:
                    # a bad message or a failed call answers an error; it never ends the service
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    await stream.send(encode(reply))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return

    async def handle(self, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise TypeError("a message is a JSON object")
        op = message.get("op")
        if op == "lookup":
            started = time.perf_counter()
            self._take_profile(message.get("profile"))
            try:
                tokens = message["tokens"]
                if isinstance(tokens, str):  # packed (pack_tokens): a tensor over the bytes, no list
                    tokens = torch.frombuffer(unpack_tokens(tokens), dtype=torch.int64) if tokens else []
                reply = await self.lookup(str(message["req"]), tokens, bool(message.get("prefetch")))
                expect = message.get("expect")
                if isinstance(expect, dict):  # a request a prefill server computed: watch for its pages
                    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
                    reply["expect"] = self.handoffs.expect(
                        str(message["req"]), ids, int(expect["tokens"]), expect.get("checks"),
                        self.config.parallel.tp_rank, expect.get("id"), expect.get("pulse_s"),
                    )
                return reply
            finally:
                self.worker_profile.add("serve_lookup", time.perf_counter() - started)
        if op == "forget":
            self.forget(str(message["req"]))
            self.handoffs.forget(str(message["req"]), finished=bool(message.get("finished", True)))
            self._take_profile(message.get("profile"))
            return {}
        if op == "handoff":
            handoff_id = message.get("id")
            return await self.handoffs.handoff(str(message["req"]), message["tokens"],
                                               handoff_id if isinstance(handoff_id, str) else None)
        if op == "stats":
            await self._settle_steps(_SETTLE_TIMEOUT_S)  # the steps vLLM has ended are counted
            return self.stats()
        if op == "wait_idle":
            with anyio.fail_after(float(message.get("timeout_s", 60))):
                await self.settle()
            return {}
        return {"error": f"unknown op {op!r}"}

    # -- scheduler requests ---------------------------------------------------------------------

    async def lookup(self, req_id: str, tokens: list[int] | torch.Tensor, prefetch: bool) -> dict[str, Any]:
        """How many leading tokens hicache holds; with ``prefetch``, start bringing storage pages up."""
        if not len(tokens):
            return {"tokens": 0, "by_tier": {}}
        await self._catch_up()
        hit = await self._cache.lookup(tokens, prefetch=prefetch)
        self.counters.lookups += 1
        if prefetch:
            self.counters.lookup_hit_tokens += hit.tokens
        if hit.prefetch is not None:
            old = self._held.pop(req_id, None)
            if old is not None and old is not hit.prefetch:
                self._release(old)
            self._held[req_id] = hit.prefetch
            self.counters.prefetches_held += 1
        # held: the request has a prefetch to end when it finishes (else the scheduler need not say)
        return {"tokens": hit.tokens, "by_tier": dict(hit.by_tier), "held": req_id in self._held}

    def spawn(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` in the service's task group (it ends with the service)."""
        if self._tg is None:
            raise HiCacheError("the connector's service is not running")
        self._tg.start_soon(fn, *args)

    async def wait_for_ended_steps(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the steps vLLM ended before now have finished (their
        saves committed): what a hand-off of their request may promise."""
        target = self.finishes_scheduled
        with anyio.move_on_after(timeout_s):
            while self.finishes_done < target:
                await self._step_finished.wait()

    def begin_receives(self, specs: list[ReceiveSpec], copy_in: CopyIn) -> None:
        """From vLLM's thread (the step's metadata): these requests have blocks for their hand-off."""
        for spec in specs:
            self.handoffs.begin(spec, copy_in)

    async def _catch_up(self) -> None:
        """Wait (briefly) for the steps vLLM ended before this lookup: a request that arrives right
        after the one whose last step saved its prefix then finds those pages committed."""
        target = self.finishes_scheduled
        if self.finishes_done >= target:
            return
        started = time.perf_counter()
        with anyio.move_on_after(_CATCH_UP_S):
            while self.finishes_done < target:
                await self._step_finished.wait()
        self.worker_profile.add("catch_up", time.perf_counter() - started)

    def _take_profile(self, profile: Any) -> None:
        """The scheduler's hook profile (cumulative), sent with its forget messages."""
        if isinstance(profile, dict):
            self.scheduler_profile = {
                str(k): [float(v[0]), float(v[1])] for k, v in profile.items() if isinstance(v, list) and len(v) == 2
            }

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted: end its prefetch unless another request shares it."""
        op = self._held.pop(req_id, None)
        if op is not None:
            self._release(op)

    def _release(self, op: Prefetch) -> None:
        if any(other is op for other in self._held.values()) or op.done:
            return
        op.cancel()
        self.counters.prefetches_cancelled += 1

    # -- steps ----------------------------------------------------------------------------------

    async def open_step(self, loads: list[LoadSpec], saves: list[SaveSpec]) -> StepLeases:
        """Lease what a step needs: each load's pages after what vLLM holds, held where they lie
        (``HiCache.hold``; pages only storage holds are prefetched into the host tier first), and
        fresh pages of the host tier (the device tier without one) for each save.

        Where the host tier cannot take a step's pages (a host smaller than a prompt, or pinned
        full), the device tier stages them, if it is large enough (``staging_tokens``): a load
        comes up through it run by run (``retrieve``), a save is reserved there and backed up to
        the host run by run. A load or save that cannot be had gets ``None`` (the load is reported
        failed, the save skipped); only a closed or failed cache raises.
        """
        step = StepLeases()
        self.open_steps += 1
        try:
            for spec in loads:
                started = time.perf_counter()
                step.holds.append(await self._hold(step.stack, spec))
                step.hold_s += time.perf_counter() - started
            for spec in saves:
                step.reservations.append(await self._reserve(step.stack, spec))
        except BaseException:
            await self.close_step(step)
            raise
        return step

    async def _hold(self, stack: AsyncExitStack, spec: LoadSpec) -> HeldPrefix | _Staged | None:
        cache = self._cache
        ps = cache.page_size
        try:
            held = await stack.enter_async_context(cache.hold(spec.tokens, start=spec.first_page * ps))
            if held.tokens >= spec.end_page * ps or self.staging_pages < 2:
                return held
            # The host tier could not hold the whole prefix: stage it through the device tier (the
            # cache's hit counters then count this load's held part twice: the hold's and the retrieve's).
            held.release()
            view = await stack.enter_async_context(cache.retrieve(spec.tokens))
            await view.wait_all()
            return _Staged(view, spec.first_page, ps, held.thin)
        except HiCacheError as exc:
            log.warning("hicache: hold for %s failed: %r", spec.req_id, exc)
            return None

    async def _reserve(self, stack: AsyncExitStack, spec: SaveSpec) -> SlotReservation | None:
        cache = self._cache
        tiers = [self.save_tier] + (["device"] if self.save_tier == "host" and spec.num_pages <= self.staging_pages else [])
        for tier in tiers:
            try:
                return await stack.enter_async_context(cache.reserve(spec.num_pages, tier=tier))
            except HiCacheError as exc:
                log.debug("hicache: no %s room to save %d pages of %s: %r", tier, spec.num_pages, spec.req_id, exc)
        self.counters.save_skipped_pages += spec.num_pages
        return None

    async def commit(self, step: StepLeases, saves: list[SaveSpec], skip: set[str]) -> None:
        """Publish the pages saved this step (``skip``: requests whose KV must not be kept)."""
        for spec, res in zip(saves, step.reservations):
            if res is None:
                continue
            if spec.req_id in skip:
                self.counters.save_skipped_pages += spec.num_pages
                continue
            try:
                added = await res.commit(spec.tokens, spec.first_page, checkpoints=spec.checkpoints or None)
            except HiCacheError as exc:
                log.warning("hicache: commit for %s failed: %r", spec.req_id, exc)
                continue
            self.counters.saves += 1
            self.counters.saved_tokens += added

    def schedule_finish(
        self, step: StepLeases, saves: list[SaveSpec] | None, skip: set[str],
        records: list[tuple[str, int, dict[str, int], int]],
    ) -> None:
        """From vLLM's thread, without waiting: end this step on the loop (``_finish_steps``).

        The step's pages are already copied into its reserved device pages; committing them,
        releasing its leases and counting its loads need not hold vLLM's next step back.
        """
        assert self._loop is not None, "the service is not open"
        self.finishes_scheduled += 1
        self._finishes.put((step, saves, skip, records))
        self._loop.call_soon_threadsafe(self._wake_finisher)

    def _wake_finisher(self) -> None:
        self._finish_wakeup.set()  # on the loop: the event the finisher waits on now

    async def _finish_steps(self) -> None:
        """Finish the steps vLLM ended, one at a time in the order they ended, so that a request's
        pages of one step are in the index before those of its next step are committed under them."""
        while True:
            await self._finish_wakeup.wait()
            self._finish_wakeup = anyio.Event()
            while True:
                try:
                    step, saves, skip, records = self._finishes.get_nowait()
                except queue.Empty:
                    break
                try:
                    with anyio.CancelScope(shield=True):  # a started commit completes, leases are released
                        try:
                            if saves is not None:
                                await self.commit(step, saves, skip)
                        finally:
                            await self.close_step(step)
                        if records:
                            self.record_loads(records)
                except Exception as exc:  # noqa: BLE001 - one step's failure must not end the others
                    log.error("hicache: a vLLM step failed to finish: %r", exc, exc_info=exc)
                finally:
                    self.finishes_done += 1
                    done, self._step_finished = self._step_finished, anyio.Event()
                    done.set()

    async def _settle_steps(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every step vLLM ended has finished."""
        with anyio.move_on_after(timeout_s):
            while self.finishes_done < self.finishes_scheduled:
                await anyio.sleep(0.002)

    async def settle(self) -> None:
        """Every ended step finished and every background job of the cache done (for tools and tests)."""
        await self._settle_steps(_SETTLE_TIMEOUT_S)
        await self._cache.wait_idle()

    async def close_step(self, step: StepLeases) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await step.stack.aclose()
        finally:
            self.open_steps -= 1

    def record_loads(self, records: list[tuple[str, int, dict[str, int], int]]) -> None:
        """Count a step's loads: ``(request, tokens loaded, tokens by tier, tokens that failed)``."""
        for req_id, tokens, by_tier, failed in records:
            self._record_load(req_id, tokens, by_tier, failed)

    def _record_load(self, req_id: str, tokens: int, by_tier: dict[str, int], failed: int) -> None:
        c = self.counters
        c.loads += 1
        c.loaded_tokens += tokens
        for tier, n in by_tier.items():
            c.loaded_by_tier[tier] = c.loaded_by_tier.get(tier, 0) + n
        if failed:
            c.load_failures += 1
            c.failed_tokens += failed
        rec = self.records.setdefault(req_id, {"loaded_tokens": 0, "by_tier": {}, "failed_tokens": 0})
        rec["loaded_tokens"] += tokens
        rec["failed_tokens"] += failed
        for tier, n in by_tier.items():
            rec["by_tier"][tier] = rec["by_tier"].get(tier, 0) + n
        while len(self.records) > _RECORDS:
            self.records.popitem(last=False)

    # -- observability --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        cache = self._cache
        return {
            "connector": _jsonable(self.counters),
            "profile": self.profiles(),
            "loop_cpu_s": self.loop_cpu_seconds(),
            # the worker process's threads by role (the cache's loop and I/O threads, vLLM's own)
            "threads_cpu_s": threads_cpu_seconds(),
            "metrics_url": self.metrics_url,
            "cache": _jsonable(cache.stats()),
            "held_prefetches": len(self._held),
            "open_steps": self.open_steps,
            "handoffs_in_flight": list(self.handoffs.in_flight),
            "device_used_pages": cache.stats().tiers["device"].used_pages,
            "requests": dict(self.records),
            "namespace": {"model": self.config.model.name, "revision": self.config.model.revision},
            "page_size": cache.page_size,
        }


class _Staged:
    """A load brought up through the device tier (``retrieve``), shaped as a ``HeldPrefix``: the
    pages after ``first_page`` on the device tier, and which tier supplied them. ``thin``: the
    thin pages the hold it replaces saw (``HeldPrefix.thin``)."""

    def __init__(self, view: Any, first_page: int, page_size: int, thin: tuple[tuple[int, int], ...] = ()) -> None:
        self.tokens = view.tokens
        self.thin = thin
        pages = view.device_pages[first_page:]
        self.segments = [(view.tier, pages)] if pages else []
        self.by_tier = _after(view.by_tier, first_page * page_size, len(pages) * page_size)


def _after(by_tier: Any, skip: int, tokens: int) -> dict[str, int]:
    """Split ``tokens`` after the first ``skip`` of a view's prefix by the tier that held them.

    A view lists its prefix from the top tier down (device, host, then storage tiers), and the
    prefix is laid out in that order too: device pages first, then those loaded from below.
    """
    out: dict[str, int] = {}
    pos, end = 0, skip + tokens
    for tier in ["device", "host"] + [t for t in by_tier if t not in ("device", "host")]:
        n = int(by_tier.get(tier, 0))
        lo, hi = max(pos, skip), min(pos + n, end)
        if hi > lo:
            out[tier] = hi - lo
        pos += n
    return out


class _ConnectorCollector:
    """The connector's families for the worker's own ``/metrics`` (``metrics_port``)."""

    def __init__(self, service: CacheService) -> None:
        self.service = service

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        return connector_families(self.service)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict | MappingProxyType):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
