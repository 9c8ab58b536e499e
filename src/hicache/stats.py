"""Counters the cache keeps, and the frozen snapshots ``HiCache.stats()`` returns.

Latencies are kept as fixed-bucket histograms (``LatencyHistogram``): one ``bisect`` and two
additions per observation, no allocation (about 1 us in CPython, against calls that take tens of
microseconds at least); the Prometheus exporter (``hicache.metrics``) reads them at scrape time,
like every other counter.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "CacheStats", "CodecStats", "Counters", "HistogramSnapshot", "LATENCY_BUCKETS_S", "LATENCIES", "LatencyHistogram",
    "StorageBackendStats", "StorageTierStats", "TierStats", "TRANSFER_DIRECTIONS",
]

TRANSFER_DIRECTIONS = (
    "user_to_device", "user_to_host", "device_to_host", "host_to_device", "device_to_user",
    "host_to_storage", "storage_to_host",
)

#: Upper bounds (seconds) of the latency buckets: 50 us to 60 s, about x2.5 apart, then +Inf.
LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

#: The cache's own call latencies (``CacheStats.latencies``), each a ``HistogramSnapshot``:
#: ``lookup`` (whole call, storage probes included), ``store`` (whole call), ``retrieve_first_layer``
#: and ``retrieve_last_layer`` (from the ``retrieve`` call until layer 0 / the last layer is usable
#: on the device, load-back and storage waits included), ``prefetch_wait`` (how long ``retrieve``
#: waited for pages coming up from storage, as the prefetch policy allows).
LATENCIES = ("lookup", "store", "retrieve_first_layer", "retrieve_last_layer", "prefetch_wait")


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observations per bucket (not cumulative; the last bucket is +Inf), their count and sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` pairs ending with ``(inf, count)``: Prometheus buckets."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class LatencyHistogram:
    """Seconds per observation in fixed buckets; observed on the event loop (or under the GIL)."""

    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.count, self.sum)


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
    lost_pages: int = 0  # pages that left this tier without reaching the one the write policy promised
    shed_pages: int = 0  # of the used pages, those held now without their sliding layers (a compact host)
    shed_bytes: int = 0  # the memory those gave back

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes - self.shed_bytes


@dataclass(frozen=True)
class StorageBackendStats:
    """A snapshot of one storage backend's traffic and health (``StorageBackend.stats()``).

    ``errors`` and ``timeouts`` count failed calls (the cache turned each into a miss or an unrecorded
    write). ``used_bytes``/``capacity_bytes``/``stored_pages`` are ``None`` where the backend cannot tell.
    """

    kind: str
    calls: MappingProxyType[str, int]
    pages_read: int
    pages_written: int
    bytes_read: int
    bytes_written: int
    errors: int
    timeouts: int
    seconds: MappingProxyType[str, float]  # time spent in each verb
    used_bytes: int | None
    capacity_bytes: int | None
    stored_pages: int | None
    evicted_pages: int
    corrupt_pages: int  # pages that failed verification (truncated, foreign, bad checksum): misses
    latencies: MappingProxyType[str, HistogramSnapshot] = field(  # seconds per call, per verb
        default_factory=lambda: MappingProxyType({})
    )
    #: wall seconds during which at least one call of the verb was in flight: calls overlap (a tier
    #: prefetching several runs at once), and ``seconds`` adds each one's whole time
    busy_seconds: MappingProxyType[str, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class CodecStats:
    """What a storage tier's codec chain did: pages and bytes through it each way, and its time.

    ``*_logical_bytes`` are bytes of KV, ``*_stored_bytes`` what the chain made of them (what
    the backend moved); ``*_seconds`` add up the time of every page's encode or decode (in worker
    threads, several at once: CPU seconds, roughly, not wall time). ``failed_pages``: pages that did
    not decode (corrupt frame, failed decryption, foreign codec): misses, counted in
    ``corrupt_pages`` too.
    """

    stages: tuple[str, ...] = ()
    encoded_pages: int = 0
    encoded_logical_bytes: int = 0
    encoded_stored_bytes: int = 0
    encode_seconds: float = 0.0
    decoded_pages: int = 0
    decoded_logical_bytes: int = 0
    decoded_stored_bytes: int = 0
    decode_seconds: float = 0.0
    failed_pages: int = 0

    @property
    def saved_bytes(self) -> int:
        """Bytes the chain kept off the backend on writes (negative if it added some)."""
        return self.encoded_logical_bytes - self.encoded_stored_bytes


@dataclass(frozen=True)
class StorageTierStats:
    """One storage tier: what the cache did with it, and its backend's own figures.

    ``fetched_pages``: pages read and verified into host memory (prefetch). ``stored_pages``: pages
    written from host memory. ``skipped_pages``: backups not written because the tier had them.
    ``failures``: backend calls that failed or timed out and became misses or unrecorded writes.
    """

    name: str
    kind: str
    fetched_pages: int
    stored_pages: int
    skipped_pages: int
    failures: int
    hit_tokens: int  # tokens of retrieves served by pages this tier supplied
    backend: StorageBackendStats
    miss_tokens: int = 0  # tokens retrieves asked of this tier (beyond memory and the tiers above) it did not supply
    position: int = 0  # place in the storage chain, 0 = fastest (probed first)
    codec: CodecStats = field(default_factory=CodecStats)  # the tier's codec chain (empty: none)


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
    storage: Mapping[str, StorageTierStats] = field(default_factory=lambda: MappingProxyType({}))
    prefetches: int = 0  # prefetch operations started
    prefetched_pages: int = 0  # pages brought from storage into host memory
    storage_backups: int = 0  # pages written host -> storage (backups and write-back spills)
    spills_to_storage: int = 0  # of those, pages written because host eviction needed them gone
    short_retrieves: int = 0  # retrieves shorter than the memory tiers held (the device was full of leased pages)
    short_retrieve_tokens: int = 0  # tokens those retrieves left out
    eviction_waits: int = 0  # times an allocation waited for an in-flight copy down (backpressure)
    eviction_wait_s: float = 0.0  # seconds spent in those waits
    sliding_shed_pages: int = 0  # host pages whose sliding layers left memory before any page was evicted
    latencies: Mapping[str, HistogramSnapshot] = field(default_factory=lambda: MappingProxyType({}))  # see LATENCIES

    @property
    def requested_tokens(self) -> int:
        """Tokens retrieves asked for (the denominator of every hit rate)."""
        device = self.tiers.get("device")
        return 0 if device is None else device.hit_tokens + device.miss_tokens

    @property
    def lost_pages(self) -> int:
        """Pages that left memory without reaching the tier the write policy promised (should be 0)."""
        return sum(t.lost_pages for t in self.tiers.values())

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
    prefetches: int = 0
    prefetched_pages: int = 0
    storage_backups: int = 0
    spills_to_storage: int = 0
    short_retrieves: int = 0
    short_retrieve_tokens: int = 0
    eviction_waits: int = 0
    eviction_wait_s: float = 0.0
    sliding_shed_pages: int = 0
    lost_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    miss_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    evicted_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_DIRECTIONS, 0))
    latency: dict[str, LatencyHistogram] = field(default_factory=lambda: {n: LatencyHistogram() for n in LATENCIES})

    def frozen(self, d: dict[str, int]) -> Mapping[str, int]:
        return MappingProxyType(dict(d))
