"""A sink that keeps events for an engine to take (vLLM's connector hands them to its scheduler,
which publishes them with its own): bounded, never blocking, drops counted."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .base import KVEvent

__all__ = ["EventBuffer"]


class EventBuffer:
    def __init__(self, max_queue_size: int = 100_000) -> None:
        self.max_queue_size = max_queue_size
        self._events: deque[KVEvent] = deque()
        self.dropped_events = 0

    def put(self, events: Sequence[KVEvent]) -> bool:
        if not self.has_room(len(events)):
            self.dropped_events += len(events)
            return False
        self._events.extend(events)  # atomic under the GIL: the engine takes from another thread
        return True

    def has_room(self, events: int) -> bool:
        return len(self._events) + events <= self.max_queue_size

    def take(self) -> list[KVEvent]:
        """Every event put so far, in order (each once)."""
        out = []
        events = self._events
        while events:
            out.append(events.popleft())
        return out

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass
