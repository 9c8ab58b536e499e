"""Background jobs and the tracker that knows when none is left.

A job pins the nodes it moves (``Pin``) from the moment it is queued until it finishes or fails, so
neither tier can evict or free its pages in between; the pin is released in a ``finally``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from ..radix_tree import Pin, TreeNode

__all__ = ["BackupJob", "LoadJob", "StorageJob", "JobTracker"]


@dataclass(eq=False)
class BackupJob:
    """Copy ``node``'s device pages to host (write policy backup)."""

    node: TreeNode
    keys: list[bytes]
    device_pages: list[int]
    pin: Pin


@dataclass(eq=False)
class StorageJob:
    """Write ``node``'s host pages to the storage tiers; ``node.storing`` keeps them until done."""

    node: TreeNode
    keys: list[bytes]
    host_pages: list[int]


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

    def __post_init__(self) -> None:
        self._events = [anyio.Event() for _ in range(self.num_layers)]

    def layer_arrived(self, layer: int) -> None:
        """Called on the event loop when ``layer`` is usable on the device."""
        self.layers_done = max(self.layers_done, layer + 1)
        self._events[layer].set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        for event in self._events:
            event.set()
        self.finished.set()

    async def wait_layer(self, layer: int) -> None:
        await self._events[layer].wait()

    def is_ready(self, layer: int) -> bool:
        return self.error is None and self.layers_done > layer


class JobTracker:
    """Counts queued and running jobs; ``wait_idle()`` returns when the count is zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = anyio.Event()
        self._idle.set()

    def add(self) -> None:
        if self.count == 0:
            self._idle = anyio.Event()
        self.count += 1

    def done(self) -> None:
        self.count -= 1
        assert self.count >= 0
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.count:
            await self._idle.wait()
