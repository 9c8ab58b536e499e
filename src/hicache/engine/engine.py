"""``Engine``: an asyncio request loop around a ``CachedCausalLM``.

    async with Engine(lm, max_running=4) as engine:
        result = await engine.generate(Request(prompt, max_new_tokens=32))

A request is looked up in the cache when it is submitted (which starts its storage prefetch while
it waits), admitted FIFO when one of ``max_running`` slots is free and its KV (prompt plus
output) fits in ``max_kv_tokens`` beside the running requests' (a GPU engine's KV memory; one
request alone is always admitted), then prefilled and decoded. Running requests interleave at
token granularity; the model computes in a worker thread, one step at a time and prefills first,
while the event loop keeps serving the cache and the other requests.

Every ``RequestResult`` carries the seconds of each stage (``stages``: the lookup and the
sequence's own timers). Times come from ``clock`` (``time.monotonic``); with ``cpu_clock``
(``time.process_time``) each result also has ``ttft_cpu_s``, the CPU seconds the process spent
from the request's arrival to its first token, which a busy shared machine does not inflate.

Leaving the block stops admission and drains what was submitted, for at most
``shutdown_timeout_s``; what is left then is cancelled. A request that fails fails alone: its
``result()`` raises, the engine keeps serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import anyio

from ..errors import EngineClosedError, EngineOverloadedError, RequestCancelledError
from .request import Request, RequestResult

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from ..cache import Hit
    from ..integrations.transformers import CachedCausalLM

__all__ = ["Engine", "EngineStats", "RequestHandle"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    submitted: int
    finished: int
    failed: int
    cancelled: int
    waiting: int
    running: int


class RequestHandle:
    """A submitted request: ``await result()`` for its ``RequestResult``, ``cancel()`` to drop it."""

    def __init__(self, request: Request, arrival_s: float) -> None:
        self.request = request
        self.arrival_s = arrival_s
        self.hit: Hit | None = None
        self.lookup_s = 0.0
        self.arrival_cpu_s: float | None = None
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._result: RequestResult | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Drop the request: out of the queue, or stopped where it runs (its lease is released)."""
        self._scope.cancel()
        if self.hit is not None and self.hit.prefetch is not None:
            self.hit.prefetch.cancel()

    async def result(self) -> RequestResult:
        """Wait for the request; raises what it failed with, or ``RequestCancelledError``."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self, result: RequestResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()


class Engine(anyio.AsyncContextManagerMixin):
    """Serves ``Request``s with ``lm``: at most ``max_running`` at once, ``max_waiting`` queued."""

    def __init__(
        self,
        lm: CachedCausalLM,
        *,
        max_running: int = 4,
        max_waiting: int = 1024,
        max_kv_tokens: int | None = None,
        shutdown_timeout_s: float = 30.0,
        store_prompt: bool = True,
        on_result: Callable[[RequestResult], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] | None = None,
    ) -> None:
        if max_running < 1 or max_waiting < 1:
            raise ValueError("max_running and max_waiting must be >= 1")
        if max_kv_tokens is not None and max_kv_tokens < 1:
            raise ValueError("max_kv_tokens must be >= 1 (or None: no limit)")
        self.lm = lm
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_kv_tokens = max_kv_tokens
        self.shutdown_timeout_s = shutdown_timeout_s
        self.store_prompt = store_prompt  # share the prompt's pages as soon as it is prefilled
        self.on_result = on_result  # called with each finished request (e.g. EngineMetrics.observe)
        self._send, self._receive = anyio.create_memory_object_stream[RequestHandle](max_waiting)
        self._slots = anyio.Semaphore(max_running)
        self._kv_in_use = 0  # prompt + output tokens of the running requests
        self._kv_freed = anyio.Event()
        self._tg: TaskGroup | None = None
        self._open = False
        self._live: set[RequestHandle] = set()
        self._counts = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, "running": 0}
        self._clock = clock  # a benchmark's oracle stops it while it sets up a request's KV
        self._cpu_clock = cpu_clock  # e.g. time.process_time: TTFT in CPU seconds too
        self._t0 = clock()

    def now(self) -> float:
        """Seconds since the engine was made (the clock of every ``RequestResult``)."""
        return self._clock() - self._t0

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Engine]:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._open = True
                tg.start_soon(self._schedule)
                clean = False
                try:
                    yield self
                    clean = True
                finally:
                    self._open = False
                    self._send.close()  # the scheduler admits what is queued, then stops
                    if clean:
                        with anyio.move_on_after(self.shutdown_timeout_s) as scope:
                            await self._drain()
                        if scope.cancelled_caught:
                            log.warning("engine shutdown: cancelling %d unfinished requests", len(self._live))
                    for handle in list(self._live):
                        handle.cancel()
                    tg.cancel_scope.cancel()
        finally:
            # Requests still queued never reached a task that would end them.
            for handle in list(self._live):
                self._end(handle, None, RequestCancelledError(f"request {handle.request.id}: the engine shut down"))

    async def _drain(self) -> None:
        while self._live:
            await next(iter(self._live))._done.wait()

    # -- requests -------------------------------------------------------------------------------

    async def submit(self, request: Request) -> RequestHandle:
        """Queue ``request``; its cache lookup (and storage prefetch) starts now."""
        if not self._open:
            raise EngineClosedError("the engine is not running: use `async with Engine(...)`")
        if len(self._live) - self._counts["running"] >= self.max_waiting:
            raise EngineOverloadedError(f"{self.max_waiting} requests are waiting already")
        handle = RequestHandle(request, self.now())
        if self._cpu_clock is not None:
            handle.arrival_cpu_s = self._cpu_clock()
        self._live.add(handle)
        try:
            started = time.perf_counter()
            handle.hit = await self.lm.lookup(request.tokens)
            handle.lookup_s = time.perf_counter() - started
            self._send.send_nowait(handle)
            self._counts["submitted"] += 1
        except BaseException as exc:
            self._live.discard(handle)
            handle.cancel()  # a prefetch the lookup started is not left running for nobody
            handle._finish(None, exc if isinstance(exc, Exception) else RequestCancelledError("cancelled"))
            if isinstance(exc, anyio.WouldBlock):
                raise EngineOverloadedError("the waiting queue is full") from exc
            if isinstance(exc, anyio.ClosedResourceError):
                raise EngineClosedError("the engine shut down while the request was submitted") from exc
            raise
        return handle

    async def generate(self, request: Request) -> RequestResult:
        """Submit ``request`` and wait for it; cancelling the caller cancels the request."""
        handle = await self.submit(request)
        try:
            return await handle.result()
        except BaseException:
            handle.cancel()
            raise

    def stats(self) -> EngineStats:
        c = self._counts
        return EngineStats(
            submitted=c["submitted"],
            finished=c["finished"],
            failed=c["failed"],
            cancelled=c["cancelled"],
            waiting=len(self._live) - c["running"],
            running=c["running"],
        )

    # -- scheduling -----------------------------------------------------------------------------

    async def _schedule(self) -> None:
        assert self._tg is not None
        async with self._receive:
            async for handle in self._receive:
                await self._slots.acquire()
                need = self._kv_tokens(handle.request)
                while self.max_kv_tokens is not None and self._kv_in_use and self._kv_in_use + need > self.max_kv_tokens:
                    await self._kv_freed.wait()
                if handle._scope.cancel_called:
                    self._slots.release()
                    self._end(handle, None, RequestCancelledError(f"request {handle.request.id} was cancelled"))
                    continue
                self._kv_in_use += need
                self._counts["running"] += 1
                self._tg.start_soon(self._run, handle)

    @staticmethod
    def _kv_tokens(request: Request) -> int:
        return len(request.tokens) + request.max_new_tokens

    async def _run(self, handle: RequestHandle) -> None:
        request = handle.request
        result: RequestResult | None = None
        error: BaseException | None = None
        try:
            with handle._scope:
                result = await self._serve(handle)
            if result is None:
                error = RequestCancelledError(f"request {request.id} was cancelled")
        except Exception as exc:
            log.warning("request %s failed: %r", request.id, exc)
            error = exc
        finally:
            if result is None and error is None:  # the engine itself is being cancelled
                error = RequestCancelledError(f"request {request.id} was cancelled by the shutdown")
            self._counts["running"] -= 1
            self._kv_in_use -= self._kv_tokens(request)
            self._kv_freed.set()
            self._kv_freed = anyio.Event()
            self._slots.release()
            self._end(handle, result, error)

    async def _serve(self, handle: RequestHandle) -> RequestResult:
        request = handle.request
        admitted = self.now()
        times: list[float] = []
        ttft_cpu: float | None = None
        async with self.lm.sequence(request.tokens, max_new_tokens=request.max_new_tokens) as seq:
            token = await seq.prefill()
            times.append(self.now())
            if self._cpu_clock is not None and handle.arrival_cpu_s is not None:
                ttft_cpu = self._cpu_clock() - handle.arrival_cpu_s
            output = [token]
            if self.store_prompt:
                await seq.store()
            while len(output) < request.max_new_tokens and token not in request.stop_tokens:
                token = await seq.decode(token)
                times.append(self.now())
                output.append(token)
        return RequestResult(
            request=request,
            output=tuple(output),
            arrival_s=handle.arrival_s,
            admitted_s=admitted,
            token_times=tuple(times),
            prompt_tokens=seq.prompt_tokens,
            cached_tokens=seq.cached_tokens,
            by_tier=MappingProxyType(dict(seq.by_tier)),
            stages=MappingProxyType({"lookup": handle.lookup_s} | dict(seq.stages)),
            restore_wait_by_layer=tuple(seq.restore_wait_by_layer),
            ttft_cpu_s=ttft_cpu,
        )

    def _end(self, handle: RequestHandle, result: RequestResult | None, error: BaseException | None) -> None:
        self._live.discard(handle)
        key = "finished" if error is None else "cancelled" if isinstance(error, RequestCancelledError) else "failed"
        self._counts[key] += 1
        if handle.hit is not None and handle.hit.prefetch is not None and error is not None:
            handle.hit.prefetch.cancel()
        handle._finish(result, error)
        if result is not None and self.on_result is not None:
            self.on_result(result)

