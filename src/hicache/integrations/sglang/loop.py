"""A private event loop for hicache's async tiers, called from SGLang's own threads.

SGLang's cache controller calls its storage backend synchronously from several threads (the prefetch
thread asks ``batch_exists``, the I/O thread reads, the backup thread writes). hicache's tiers are
async. ``PrivateLoop`` runs one event loop in a daemon thread of its own, with an anyio
``BlockingPortal`` on it: each call from SGLang's threads runs as a task on that loop, so calls from
different threads overlap, and every tier's connections and counters live on one thread.

The thread is a daemon so that a process which never closes the backend still exits (SGLang does
not always call ``close``); ``close`` stops the portal and joins the thread within a bound.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ...errors import CacheClosedError

__all__ = ["PrivateLoop"]

T = TypeVar("T")


class PrivateLoop:
    """An event loop in a daemon thread; ``call`` runs a coroutine function on it and waits."""

    def __init__(self, name: str = "hicache-sglang", start_timeout_s: float = 30.0) -> None:
        self._ready = threading.Event()
        self._portal: BlockingPortal | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s) or self._portal is None:
            raise RuntimeError(f"hicache's event loop did not start: {self._error!r}")

    def _run(self) -> None:
        try:
            anyio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported by __init__ (start) or call (after)
            self._error = exc
        finally:
            self._portal = None
            self._ready.set()

    async def _main(self) -> None:
        async with BlockingPortal() as portal:
            self.loop = asyncio.get_running_loop()
            self._portal = portal
            self._ready.set()
            await portal.sleep_until_stopped()

    @property
    def running(self) -> bool:
        return self._portal is not None and self._thread.is_alive()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and return its result (or raise its exception)."""
        portal = self._portal
        if portal is None:
            raise CacheClosedError("hicache's SGLang backend is closed")
        return portal.call(fn, *args)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (tasks still running are cancelled) and join its thread; idempotent."""
        portal = self._portal
        if portal is not None and self._thread is not threading.current_thread():
            try:
                portal.call(portal.stop, True)
            except RuntimeError:
                pass  # already stopping
        self._thread.join(timeout_s)
