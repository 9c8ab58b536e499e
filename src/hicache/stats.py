"""Counters the cache keeps, and the frozen snapshots ``HiCache.stats()`` returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["TierStats", "CacheStats", "Counters", "TRANSFER_DIRECTIONS"]

TRANSFER_DIRECTIONS = ("user_to_device", "user_to_host", "device_to_host", "host_to_device", "device_to_user")


@dataclass(frozen=True)
class TierStats:
    """One memory tier at the moment of the snapshot.

    ``hit_tokens``: tokens that retrieves served from this tier. ``miss_tokens``: tokens that retrieves
    asked of this tier and did not find there (they came from a lower tier or not at all).
    """

    capacity_pages: int
    used_pages: int
    page_bytes: int
    hit_tokens: int
    miss_tokens: int
    evicted_pages: int

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes


@dataclass(frozen=True)
class CacheStats:
    """A frozen snapshot of the whole cache."""

    tiers: Mapping[str, TierStats]
    bytes_moved: Mapping[str, int]  # per direction, see TRANSFER_DIRECTIONS
    lookups: int
    retrieves: int
    stores: int
    stored_pages: int
    dropped_pages: int  # pages a store could not place in any tier
    backups: int  # pages backed up device -> host by the write policy
    backups_skipped: int  # backups not done (host full of leased pages, queue full)
    spills: int  # pages copied to host on device eviction
    loads: int  # pages loaded host -> device
    queue_depths: Mapping[str, int]
    in_flight: int  # background jobs not finished

    @property
    def evictions(self) -> int:
        return sum(t.evicted_pages for t in self.tiers.values())


@dataclass
class Counters:
    """Mutable counters, touched only on the event loop thread."""

    lookups: int = 0
    retrieves: int = 0
    stores: int = 0
    stored_pages: int = 0
    dropped_pages: int = 0
    backups: int = 0
    backups_skipped: int = 0
    spills: int = 0
    loads: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    miss_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    evicted_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_DIRECTIONS, 0))

    def frozen(self, d: dict[str, int]) -> Mapping[str, int]:
        return MappingProxyType(dict(d))
