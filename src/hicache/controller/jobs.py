"""Background jobs and the tracker that knows when none is left.

A job pins the nodes it moves (``Pin``) from the moment it is queued until it finishes or fails, so
neither tier can evict or free its pages in between; the pin is released in a ``finally``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio

from ..radix_tree import Pin, TreeNode

__all__ = ["BackupJob", "BoundedWait", "LoadJob", "StorageJob", "JobTracker"]


@dataclass(eq=False)
class BackupJob:
    """Copy ``node``'s device pages to host (write policy backup), by runs the host has room for.

    ``done``: the leading pages of ``keys`` copied so far (each run became a node of its own).
    """

    node: TreeNode
    keys: list[bytes]
    device_pages: list[int]
    pin: Pin
    done: int = 0


@dataclass(eq=False)
class StorageJob:
    """Write ``node``'s host pages to the storage tiers; ``node.storing`` keeps them until done.

    ``sliding_tail``: how many of the last pages (of ``node`` and up) a layer-split tier keeps
    the sliding layers of: the window (and slack) before a hit's possible end at or just below ``node``;
    ``window``: the ancestors' pages among them (each ancestor's whole keys when the job began,
    and those pages' keys and host pages), whose ``storing`` keeps them as well. ``thin``: the
    node's leading pages held thin when the job began (their sliding layers are zeros: never
    written as a sliding part).
    """

    node: TreeNode
    keys: list[bytes]
    host_pages: list[int]
    sliding_tail: int = 0
    thin: int = 0
    window: list[tuple[TreeNode, list[bytes], list[bytes], list[int]]] = field(default_factory=list)

    @property
    def window_keys(self) -> list[bytes]:
        return [k for _, _, keys, _ in reversed(self.window) for k in keys]

    @property
    def window_pages(self) -> list[int]:
        return [p for _, _, _, pages in reversed(self.window) for p in pages]


@dataclass(eq=False)
class LoadEntry:
    node: TreeNode
    keys: list[bytes]


@dataclass(eq=False)
class LoadJob:
    """Load host pages into freshly allocated device pages, layer by layer."""

    entries: list[LoadEntry]
    host_pages: list[int]
    device_pages: list[int]
    num_layers: int
    pin: Pin
    layers_done: int = 0
    error: BaseException | None = None
    _events: list[anyio.Event] = field(default_factory=list)
    finished: anyio.Event = field(default_factory=anyio.Event)
    #: Called (on the event loop) with "first" when layer 0 is usable and "last" when every layer
    #: is: what the retrieve latency histograms are timed by. Not called when the job fails.
    watchers: list[Callable[[str], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._events = [anyio.Event() for _ in range(self.num_layers)]

    def layer_arrived(self, layer: int) -> None:
        """Called on the event loop when ``layer`` is usable on the device."""
        first = not self._events[0].is_set()
        self.layers_done = max(self.layers_done, layer + 1)
        self._events[layer].set()
        if first and self._events[0].is_set():
            self._notify("first")

    def succeeded(self) -> None:
        """Every layer has arrived: the job is done."""
        self.finished.set()
        self._notify("last")

    def _notify(self, what: str) -> None:
        for watcher in list(self.watchers):
            watcher(what)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.watchers.clear()
        for event in self._events:
            event.set()
        self.finished.set()

    async def wait_layer(self, layer: int) -> None:
        await self._events[layer].wait()

    def is_ready(self, layer: int) -> bool:
        return self.error is None and self.layers_done > layer


class JobTracker:
    """Counts queued and running jobs; ``wait_idle()`` returns when the count is zero.

    ``wait_done()`` returns when the next job finishes: the eviction loop waits on it for pages
    that an in-flight copy is about to make free (``BoundedWait``).
    """

    def __init__(self) -> None:
        self.count = 0
        self.completed = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._done = anyio.Event()

    def add(self) -> None:
        if self.count == 0:
            self._idle = anyio.Event()
        self.count += 1

    def done(self) -> None:
        self.count -= 1
        assert self.count >= 0
        self.completed += 1
        self._done.set()
        self._done = anyio.Event()
        if self.count == 0:
            self._idle.set()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count one job for the duration of a block."""
        self.add()
        try:
            yield
        finally:
            self.done()

    async def wait_idle(self) -> None:
        while self.count:
            await self._idle.wait()

    async def wait_done(self) -> None:
        await self._done.wait()


class BoundedWait:
    """Waits, one job completion at a time, for jobs that may make room; never past a deadline.

    Only jobs that finish without waiting for room themselves are tracked (copies, writes, stores
    past their allocation), so two callers never wait on each other. ``next()`` is False when
    nothing is in flight or the deadline has passed: then there is no room to be had.
    """

    def __init__(self, tracker: JobTracker, max_wait_s: float, on_wait: Callable[[float], None] | None = None) -> None:
        self.tracker = tracker
        self.on_wait = on_wait
        self._deadline = anyio.current_time() + max_wait_s

    async def next(self) -> bool:
        left = self._deadline - anyio.current_time()
        if self.tracker.count == 0 or left <= 0:
            return False
        started = anyio.current_time()
        with anyio.move_on_after(left):
            await self.tracker.wait_done()
        if self.on_wait is not None:
            self.on_wait(anyio.current_time() - started)
        return True
