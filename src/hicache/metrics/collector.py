"""``HiCacheCollector``: the cache's counters as Prometheus metrics, read at scrape time.

Nothing is counted twice: every figure comes from ``HiCache.stats()`` when Prometheus scrapes (the
histograms too: the cache keeps fixed-bucket ones, ``stats.LatencyHistogram``), so the request path
pays nothing for the exporter. A scrape from another thread (an engine's own metrics server) takes
its snapshot on the cache's event loop, bounded by ``timeout_s``. The metric list is ``METRICS``
below and in docs/operating.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..stats import CacheStats, HistogramSnapshot

if TYPE_CHECKING:
    from ..cache import HiCache

__all__ = ["HiCacheCollector", "METRICS"]

#: name (without the ``_total`` a counter gets) -> (type, labels, help)
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # every tier: device, host and each storage tier (kind: device, host, file, redis, ...)
    "tier_capacity_bytes": ("gauge", ("tier", "kind"), "Bytes the tier may hold (storage: its `capacity`, when set)"),
    "tier_used_bytes": ("gauge", ("tier", "kind"), "Bytes in use (storage: what this process knows it stored)"),
    "tier_capacity_pages": ("gauge", ("tier", "kind"), "Pages the memory tier holds"),
    "tier_used_pages": ("gauge", ("tier", "kind"), "Pages in use (storage: what this process knows it stored)"),
    "tier_hit_tokens": ("counter", ("tier", "kind"), "Tokens retrieves got from this tier"),
    "tier_miss_tokens": ("counter", ("tier", "kind"), "Tokens retrieves asked of this tier that it did not supply"),
    "tier_evicted_pages": ("counter", ("tier", "kind"), "Pages evicted from the tier"),
    "tier_lost_pages": ("counter", ("tier", "kind"), "Pages that left memory without reaching the tier the write policy promised (should stay 0)"),
    "tier_shed_pages": ("gauge", ("tier", "kind"), "Pages held now without their sliding layers' memory (a compact host)"),
    # storage tiers
    "storage_position": ("gauge", ("tier", "kind"), "Place of the tier in the storage chain (0: fastest, probed first)"),
    "storage_fetched_pages": ("counter", ("tier", "kind"), "Pages read and verified into host memory (prefetch)"),
    "storage_stored_pages": ("counter", ("tier", "kind"), "Pages written from host memory"),
    "storage_skipped_pages": ("counter", ("tier", "kind"), "Pages not written because the tier had them"),
    "storage_failures": ("counter", ("tier", "kind"), "Backend calls that failed or timed out (turned into misses)"),
    "storage_corrupt_pages": ("counter", ("tier", "kind"), "Pages that failed verification (misses, removed)"),
    "storage_transferred_bytes": ("counter", ("tier", "kind", "direction"), "Bytes the backend read or wrote"),
    "storage_transferred_pages": ("counter", ("tier", "kind", "direction"), "Pages the backend read or wrote"),
    "storage_backend_calls": ("counter", ("tier", "kind", "verb"), "Backend calls per verb"),
    "storage_backend_errors": ("counter", ("tier", "kind"), "Backend calls that raised"),
    "storage_backend_timeouts": ("counter", ("tier", "kind"), "Backend calls that exceeded timeout_s"),
    "storage_backend_call_seconds": ("histogram", ("tier", "kind", "verb"), "Latency of every backend call, per verb"),
    "storage_codec_pages": ("counter", ("tier", "kind", "direction"), "Pages through the tier's codec chain (encode, decode)"),
    "storage_codec_bytes": ("counter", ("tier", "kind", "direction", "form"), "Bytes through the codec chain: logical (KV) and stored, per direction"),
    "storage_codec_seconds": ("counter", ("tier", "kind", "direction"), "Time encoding or decoding pages (summed over worker threads)"),
    "storage_codec_failed_pages": ("counter", ("tier", "kind"), "Pages that failed to decode or decrypt (misses)"),
    # the cache
    "bytes_moved": ("counter", ("direction",), "Bytes moved per boundary (user/device/host/storage)"),
    "lookups": ("counter", (), "lookup calls"),
    "retrieves": ("counter", (), "retrieve calls"),
    "stores": ("counter", (), "store calls"),
    "retrieve_requested_tokens": ("counter", (), "Tokens retrieves asked for (the denominator of hit rates)"),
    "stored_pages": ("counter", (), "Pages stores newly cached"),
    "dropped_pages": ("counter", (), "Pages a store could not place in any tier"),
    "backup_pages": ("counter", (), "Pages backed up device -> host by the write policy"),
    "backup_skipped_pages": ("counter", (), "Backups not done (host full of leased pages, queue full)"),
    "spilled_pages": ("counter", (), "Pages copied to host on device eviction"),
    "loaded_pages": ("counter", (), "Pages loaded host -> device"),
    "prefetches": ("counter", (), "Prefetch operations started"),
    "prefetched_pages": ("counter", (), "Pages brought from storage into host memory"),
    "storage_backup_pages": ("counter", (), "Pages written host -> storage (backups and spills)"),
    "storage_spilled_pages": ("counter", (), "Of those, pages written because host eviction needed them gone"),
    "short_retrieves": ("counter", (), "Retrieves shorter than memory held (device full of leased pages)"),
    "short_retrieve_tokens": ("counter", (), "Tokens those retrieves left out"),
    "eviction_waits": ("counter", (), "Allocations that waited for an in-flight copy down (backpressure)"),
    "eviction_wait_seconds": ("counter", (), "Seconds spent in those waits"),
    "sliding_shed_pages": ("counter", (), "Host pages whose sliding layers left memory (a compact host sheds them before it evicts)"),
    "queue_depth": ("gauge", ("queue",), "Jobs queued per background queue (backup, load, storage, prefetch)"),
    "jobs_in_flight": ("gauge", (), "Background jobs not finished"),
    "lookup_seconds": ("histogram", (), "lookup latency (storage probes included)"),
    "store_seconds": ("histogram", (), "store latency"),
    "retrieve_first_layer_seconds": ("histogram", (), "From retrieve until layer 0 is usable on the device"),
    "retrieve_last_layer_seconds": ("histogram", (), "From retrieve until every layer is usable on the device"),
    "prefetch_wait_seconds": ("histogram", (), "How long retrieve waited for pages coming up from storage"),
}

_LATENCY_METRIC = {
    "lookup": "lookup_seconds",
    "store": "store_seconds",
    "retrieve_first_layer": "retrieve_first_layer_seconds",
    "retrieve_last_layer": "retrieve_last_layer_seconds",
    "prefetch_wait": "prefetch_wait_seconds",
}


class HiCacheCollector(Collector):
    """Register with any ``prometheus_client`` registry: ``registry.register(HiCacheCollector(cache))``.

    ``const_labels`` are added to every sample (e.g. ``{"engine": "replica-3"}``); ``prefix``
    starts every name (``hicache``).
    """

    def __init__(
        self, cache: HiCache, *, prefix: str = "hicache", const_labels: Mapping[str, str] | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.cache = cache
        self.prefix = prefix
        self.const = dict(const_labels or {})
        self.timeout_s = timeout_s

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families depend on the tiers attached at scrape time

    def snapshot(self) -> CacheStats:
        """``cache.stats()``, taken on the cache's event loop when called from another thread."""
        loop = self.cache.loop
        if loop is None or not loop.is_running():
            return self.cache.stats()
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            return self.cache.stats()
        done: concurrent.futures.Future[CacheStats] = concurrent.futures.Future()

        def take() -> None:
            try:
                done.set_result(self.cache.stats())
            except BaseException as exc:  # noqa: BLE001 - handed to the scraping thread
                done.set_exception(exc)

        loop.call_soon_threadsafe(take)
        return done.result(timeout=self.timeout_s)

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        families: dict[str, Metric] = {}
        names = list(self.const)

        def family(name: str) -> Metric:
            if name not in families:
                kind, labels, doc = METRICS[name]
                full = f"{self.prefix}_{name}"
                cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}[kind]
                families[name] = cls(full, doc, labels=[*names, *labels])
            return families[name]

        def add(name: str, value: float, *labels: str) -> None:
            family(name).add_metric([*self.const.values(), *labels], value)

        def add_histogram(name: str, h: HistogramSnapshot, *labels: str) -> None:
            buckets = [(floatToGoString(bound), float(n)) for bound, n in h.cumulative()]
            family(name).add_metric([*self.const.values(), *labels], buckets, h.sum)  # type: ignore[call-arg]

        for tier, t in stats.tiers.items():
            add("tier_capacity_bytes", t.capacity_bytes, tier, tier)
            add("tier_used_bytes", t.used_bytes, tier, tier)
            add("tier_capacity_pages", t.capacity_pages, tier, tier)
            add("tier_used_pages", t.used_pages, tier, tier)
            add("tier_hit_tokens", t.hit_tokens, tier, tier)
            add("tier_miss_tokens", t.miss_tokens, tier, tier)
            add("tier_evicted_pages", t.evicted_pages, tier, tier)
            add("tier_lost_pages", t.lost_pages, tier, tier)
            add("tier_shed_pages", t.shed_pages, tier, tier)
        for tier, s in stats.storage.items():
            b, kind = s.backend, s.kind
            if b.capacity_bytes is not None:
                add("tier_capacity_bytes", b.capacity_bytes, tier, kind)
            if b.used_bytes is not None:
                add("tier_used_bytes", b.used_bytes, tier, kind)
            if b.stored_pages is not None:
                add("tier_used_pages", b.stored_pages, tier, kind)
            add("tier_hit_tokens", s.hit_tokens, tier, kind)
            add("tier_miss_tokens", s.miss_tokens, tier, kind)
            add("tier_evicted_pages", b.evicted_pages, tier, kind)
            add("storage_position", s.position, tier, kind)
            add("storage_fetched_pages", s.fetched_pages, tier, kind)
            add("storage_stored_pages", s.stored_pages, tier, kind)
            add("storage_skipped_pages", s.skipped_pages, tier, kind)
            add("storage_failures", s.failures, tier, kind)
            add("storage_corrupt_pages", b.corrupt_pages, tier, kind)
            add("storage_transferred_bytes", b.bytes_read, tier, kind, "read")
            add("storage_transferred_bytes", b.bytes_written, tier, kind, "write")
            add("storage_transferred_pages", b.pages_read, tier, kind, "read")
            add("storage_transferred_pages", b.pages_written, tier, kind, "write")
            for verb, n in b.calls.items():
                add("storage_backend_calls", n, tier, kind, verb)
            add("storage_backend_errors", b.errors, tier, kind)
            add("storage_backend_timeouts", b.timeouts, tier, kind)
            for verb, h in b.latencies.items():
                add_histogram("storage_backend_call_seconds", h, tier, kind, verb)
            c = s.codec
            if c.stages:
                add("storage_codec_pages", c.encoded_pages, tier, kind, "encode")
                add("storage_codec_pages", c.decoded_pages, tier, kind, "decode")
                add("storage_codec_bytes", c.encoded_logical_bytes, tier, kind, "encode", "logical")
                add("storage_codec_bytes", c.encoded_stored_bytes, tier, kind, "encode", "stored")
                add("storage_codec_bytes", c.decoded_logical_bytes, tier, kind, "decode", "logical")
                add("storage_codec_bytes", c.decoded_stored_bytes, tier, kind, "decode", "stored")
                add("storage_codec_seconds", c.encode_seconds, tier, kind, "encode")
                add("storage_codec_seconds", c.decode_seconds, tier, kind, "decode")
                add("storage_codec_failed_pages", c.failed_pages, tier, kind)
        for direction, n in stats.bytes_moved.items():
            add("bytes_moved", n, direction)
        for name, value in (
            ("lookups", stats.lookups), ("retrieves", stats.retrieves), ("stores", stats.stores),
            ("retrieve_requested_tokens", stats.requested_tokens), ("stored_pages", stats.stored_pages),
            ("dropped_pages", stats.dropped_pages), ("backup_pages", stats.backups),
            ("backup_skipped_pages", stats.backups_skipped), ("spilled_pages", stats.spills),
            ("loaded_pages", stats.loads), ("prefetches", stats.prefetches),
            ("prefetched_pages", stats.prefetched_pages), ("storage_backup_pages", stats.storage_backups),
            ("storage_spilled_pages", stats.spills_to_storage), ("short_retrieves", stats.short_retrieves),
            ("short_retrieve_tokens", stats.short_retrieve_tokens), ("eviction_waits", stats.eviction_waits),
            ("eviction_wait_seconds", stats.eviction_wait_s), ("jobs_in_flight", stats.in_flight),
            ("sliding_shed_pages", stats.sliding_shed_pages),
        ):
            add(name, value)
        for queue, n in stats.queue_depths.items():
            add("queue_depth", n, queue)
        for name, h in stats.latencies.items():
            add_histogram(_LATENCY_METRIC[name], h)
        yield from families.values()
