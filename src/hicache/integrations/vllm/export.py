"""The worker's metrics as plain data, for the trip through vLLM's processes to its ``/metrics``.

The cache lives in vLLM's worker process; vLLM's ``/metrics`` is served by its API server process.
vLLM carries a connector's stats from the worker through the engine core to the API server
(``get_kv_connector_stats``, pickled and then msgpack-encoded on the way), so what crosses is a
list of metric families as lists, strings and numbers: hicache's own (``HiCacheCollector``: tiers,
storage, latency histograms, exactly what ``hicache.metrics.serve`` exports) and the connector's
(``CONNECTOR_METRICS`` below). Cumulative values, so a report that vLLM drops or merges loses
nothing: the API server exports the latest one it received.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["CONNECTOR_METRICS", "ConnectorState", "connector_families", "encode", "decode"]


class ConnectorState(Protocol):
    """What ``connector_families`` reads: the worker's ``CacheService`` (``service.py``) has it."""

    counters: Any  # the service's ConnectorCounters: lookups, loads, saves, prefetches, hand-offs
    open_steps: int
    handoffs: Any  # the service's Handoffs: ``in_flight`` (sends, receives)

    @property
    def held_prefetches(self) -> int: ...

    def profiles(self) -> Mapping[str, Mapping[str, Sequence[float]]]: ...

    def loop_cpu_seconds(self) -> float | None: ...

#: name (after ``hicache_``, without the ``_total`` a counter gets) -> (type, labels, help)
CONNECTOR_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "vllm_lookups": ("counter", (), "Lookups the scheduler made over the channel (queued and scheduling-time)"),
    "vllm_lookup_hit_tokens": ("counter", (), "Tokens hicache held when a request was queued"),
    "vllm_loads": ("counter", (), "Requests whose cached prefix the connector loaded into vLLM's blocks"),
    "vllm_loaded_tokens": ("counter", ("tier",), "Tokens loaded into vLLM's blocks, by the tier that held them"),
    "vllm_load_failures": ("counter", (), "Loads that came up short (vLLM recomputed the rest)"),
    "vllm_failed_tokens": ("counter", (), "Tokens promised by a lookup that could not be loaded (recomputed)"),
    "vllm_saves": ("counter", (), "Request steps whose new pages were saved"),
    "vllm_saved_tokens": ("counter", (), "Tokens saved from vLLM's blocks into hicache (newly cached)"),
    "vllm_save_skipped_pages": ("counter", (), "Pages not saved (no host room, or a failed load in the step)"),
    "vllm_prefetches_held": ("counter", (), "Storage prefetches started by a queued request's lookup"),
    "vllm_prefetches_cancelled": ("counter", (), "Prefetches ended because their request finished or was aborted"),
    "vllm_held_prefetches": ("gauge", (), "Prefetches held for queued requests now"),
    "vllm_open_steps": ("gauge", (), "vLLM steps holding leases now"),
    "vllm_hook_calls": ("counter", ("side", "hook"), "Calls of each connector hook (side: scheduler or worker)"),
    "vllm_hook_seconds": ("counter", ("side", "hook"), "Seconds spent in each connector hook, on vLLM's critical path"),
    "vllm_loop_cpu_seconds": ("counter", (), "CPU seconds of the worker's cache thread (channel, commits, background copies)"),
    "vllm_pd_sends": ("counter", (), "Prefill hand-offs whose prompt was durable in the shared tier within send_timeout_s"),
    "vllm_pd_sent_tokens": ("counter", (), "Tokens handed off durable to decode servers"),
    "vllm_pd_send_failures": ("counter", (), "Hand-offs not (all) durable in time: the decode server recomputed"),
    "vllm_pd_gave_up_notices": ("counter", (), "Failed hand-offs whose gave-up marker reached the shared tier"),
    "vllm_pd_send_seconds": ("counter", (), "Seconds from a hand-off to its pages durable (or given up), summed"),
    "vllm_pd_receives": ("counter", (), "Hand-offs received whole: every promised page copied into vLLM's blocks"),
    "vllm_pd_received_tokens": ("counter", (), "Tokens received from prefill servers"),
    "vllm_pd_receive_failures": ("counter", (), "Receives that came up short within receive_timeout_s (vLLM recomputed)"),
    "vllm_pd_receives_given_up": ("counter", (), "Receives ended early: the prefill server said it gave up"),
    "vllm_pd_receives_producer_silent": ("counter", (), "Receives ended early: the prefill server's pulse stopped"),
    "vllm_pd_receives_refused": ("counter", (), "Hand-offs of another namespace (weights, tenant, page size): computed here"),
    "vllm_pd_receive_retries": ("counter", (), "Reads of a hand-off's listed pages that came up short and were asked again"),
    "vllm_pd_receive_wait_seconds": ("counter", (), "Seconds from a queued request to its hand-off copied in, summed"),
    "vllm_pd_copy_seconds": ("counter", (), "Seconds copying received pages into vLLM's blocks (cache threads), summed"),
    "vllm_pd_in_flight": ("gauge", ("side",), "Hand-offs in flight now (side: send or receive)"),
}


def connector_families(service: ConnectorState, prefix: str = "hicache") -> list[Metric]:
    """The connector's metrics from ``service`` (call on the cache's event loop)."""
    families: dict[str, Metric] = {}

    def add(name: str, value: float, *labels: str) -> None:
        if name not in families:
            kind, names, doc = CONNECTOR_METRICS[name]
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            families[name] = cls(f"{prefix}_{name}", doc, labels=list(names))
        families[name].add_metric(list(labels), value)

    c = service.counters
    add("vllm_lookups", c.lookups)
    add("vllm_lookup_hit_tokens", c.lookup_hit_tokens)
    add("vllm_loads", c.loads)
    for tier, n in sorted(c.loaded_by_tier.items()):
        add("vllm_loaded_tokens", n, tier)
    add("vllm_load_failures", c.load_failures)
    add("vllm_failed_tokens", c.failed_tokens)
    add("vllm_saves", c.saves)
    add("vllm_saved_tokens", c.saved_tokens)
    add("vllm_save_skipped_pages", c.save_skipped_pages)
    add("vllm_prefetches_held", c.prefetches_held)
    add("vllm_prefetches_cancelled", c.prefetches_cancelled)
    add("vllm_held_prefetches", service.held_prefetches)
    add("vllm_open_steps", service.open_steps)
    for side, profile in service.profiles().items():
        for hook, (calls, seconds) in profile.items():
            add("vllm_hook_calls", calls, side, hook)
            add("vllm_hook_seconds", seconds, side, hook)
    cpu = service.loop_cpu_seconds()
    if cpu is not None:
        add("vllm_loop_cpu_seconds", cpu)
    for name in ("sends", "sent_tokens", "send_failures", "gave_up_notices", "receives", "received_tokens",
                 "receive_failures", "receives_given_up", "receives_producer_silent", "receives_refused",
                 "receive_retries"):
        add(f"vllm_pd_{name}", getattr(c, f"pd_{name}"))
    add("vllm_pd_send_seconds", c.pd_send_s)
    add("vllm_pd_receive_wait_seconds", c.pd_receive_wait_s)
    add("vllm_pd_copy_seconds", c.pd_copy_s)
    sends, receives = service.handoffs.in_flight
    add("vllm_pd_in_flight", sends, "send")
    add("vllm_pd_in_flight", receives, "receive")
    return list(families.values())


def encode(families: Iterable[Metric]) -> list[list[Any]]:
    """``[[name, type, help, [[sample name, {label: value}, value], ...]], ...]``."""
    return [
        [m.name, m.type, m.documentation, [[s.name, dict(s.labels), float(s.value)] for s in m.samples]]
        for m in families
    ]


def decode(data: Iterable[Any], const_labels: Mapping[str, str] | None = None) -> Iterator[Metric]:
    """Metric families from ``encode``'s output, ``const_labels`` added to every sample.

    Malformed entries are skipped: the payload came through other processes, and a scrape must
    not fail because of one family.
    """
    const = dict(const_labels or {})
    for entry in data:
        try:
            name, kind, doc, samples = entry
            family = Metric(str(name), str(doc), str(kind))
            for sample_name, labels, value in samples:
                family.add_sample(str(sample_name), {**const, **{str(k): str(v) for k, v in labels.items()}}, float(value))
        except (TypeError, ValueError, AttributeError):
            continue
        yield family
