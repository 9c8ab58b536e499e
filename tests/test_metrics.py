"""Prometheus metrics scraped from the real HTTP endpoint during a run, parsed with prometheus-client's
parser and checked against ``stats()``; the admin routes; JSON log lines; rate-limited repeats."""

from __future__ import annotations

import io
import json
import logging
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hicache import HiCache
from hicache.engine import Engine, Request
from hicache.integrations.transformers import CachedCausalLM
from hicache.logs import RateLimited, configure
from hicache.metrics import METRICS, EngineMetrics, HiCacheCollector, serve
from hicache.stats import CacheStats

from .lm_helpers import lm_config, prompt, tiny_model
from .test_attach_detach import PAGE, PROMPT_PAGES, config, file_entry, kv_of, tokens_of


def fetch(url: str, body: dict[str, Any] | None = None, token: str | None = None,
          content_type: str | None = "application/json") -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
    if content_type is not None and body is not None:
        request.add_header("Content-Type", content_type)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """``{sample name: {labels: value}}`` from the endpoint (a worker thread, like Prometheus would)."""
    status, body = await anyio.to_thread.run_sync(fetch, url + "/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def one(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def check_against_stats(m: dict[str, dict[tuple, float]], s: CacheStats) -> None:
    for name, value in (("lookups", s.lookups), ("retrieves", s.retrieves), ("stores", s.stores),
                        ("stored_pages", s.stored_pages), ("prefetched_pages", s.prefetched_pages),
                        ("storage_backup_pages", s.storage_backups), ("loaded_pages", s.loads),
                        ("retrieve_requested_tokens", s.requested_tokens)):
        assert one(m, f"hicache_{name}_total") == value, name
    for tier, t in s.tiers.items():
        for metric, value in (("tier_hit_tokens_total", t.hit_tokens), ("tier_miss_tokens_total", t.miss_tokens),
                              ("tier_lost_pages_total", t.lost_pages), ("tier_evicted_pages_total", t.evicted_pages),
                              ("tier_used_pages", t.used_pages), ("tier_capacity_bytes", t.capacity_bytes)):
            assert one(m, f"hicache_{metric}", tier=tier, kind=tier) == value, (tier, metric)
    for tier, st in s.storage.items():
        labels = {"tier": tier, "kind": st.kind}
        assert one(m, "hicache_tier_hit_tokens_total", **labels) == st.hit_tokens
        assert one(m, "hicache_tier_miss_tokens_total", **labels) == st.miss_tokens
        assert one(m, "hicache_storage_stored_pages_total", **labels) == st.stored_pages
        assert one(m, "hicache_storage_fetched_pages_total", **labels) == st.fetched_pages
        assert one(m, "hicache_storage_transferred_bytes_total", direction="write", **labels) == st.backend.bytes_written
        assert one(m, "hicache_storage_position", **labels) == st.position
        for verb, calls in st.backend.calls.items():
            assert one(m, "hicache_storage_backend_calls_total", verb=verb, **labels) == calls
            # every backend call is in the latency histogram
            assert one(m, "hicache_storage_backend_call_seconds_count", verb=verb, **labels) == calls
    for direction, n in s.bytes_moved.items():
        assert one(m, "hicache_bytes_moved_total", direction=direction) == n
    for name, h in s.latencies.items():
        assert one(m, f"hicache_{name}_seconds_count") == h.count
        assert one(m, f"hicache_{name}_seconds_bucket", le="+Inf") == h.count
        assert one(m, f"hicache_{name}_seconds_sum") == pytest.approx(h.sum)


async def test_scraped_metrics_match_stats_during_and_after_a_run(tmp_path: Path, valkey) -> None:
    redis = {"kind": "redis", "name": "valkey", "url": f"redis://127.0.0.1:{valkey.port}/0",
             "key_prefix": f"m{uuid.uuid4().hex[:10]}", "timeout_s": 5.0}
    work = [(tokens_of(i), kv_of(i)) for i in range(10)]
    async with HiCache.from_config(config([file_entry(tmp_path), redis], device_pages=8, host_pages=16)) as cache:
        async with serve(cache, port=0) as server:
            mid = None
            for i, (tokens, kv) in enumerate(work):
                await cache.store(tokens, kv)
                if i == 5:
                    mid = await scrape(server.url)  # while backups and writes are in flight
            assert mid is not None and one(mid, "hicache_stores_total") >= 6
            for tokens, _ in work:  # the early prompts left memory: served from storage
                await cache.lookup(tokens)
                async with cache.retrieve(tokens) as view:
                    assert view.tokens == PROMPT_PAGES * PAGE
            await cache.wait_idle()
            samples = await scrape(server.url)
            stats = cache.stats()
            check_against_stats(samples, stats)
            assert stats.prefetched_pages > 0 and stats.latencies["retrieve_last_layer"].count == len(work)
            assert stats.latencies["retrieve_first_layer"].count == len(work)
            assert one(samples, "hicache_tier_hit_tokens_total", tier="disk", kind="file") > 0
            assert set(n.removesuffix("_total") for n in (f.name for f in text_string_to_metric_families(
                (await anyio.to_thread.run_sync(fetch, server.url + "/metrics"))[1].decode()))) <= {
                f"hicache_{name}" for name in METRICS}
            status, body = await anyio.to_thread.run_sync(fetch, server.url + "/healthz")
            assert (status, body) == (200, b"ok\n")
            assert (await anyio.to_thread.run_sync(fetch, server.url + "/admin/storage"))[0] == 404  # admin off


async def test_a_scrape_from_another_thread_reads_the_cache_on_its_loop(tmp_path: Path) -> None:
    """An engine's own metrics server scrapes from its thread: the collector hops to the cache's loop."""
    registry = CollectorRegistry()
    async with HiCache.from_config(config([file_entry(tmp_path)])) as cache:
        registry.register(HiCacheCollector(cache, const_labels={"replica": "r1"}))
        for i in range(4):
            await cache.store(tokens_of(i), kv_of(i))

        def in_thread() -> str:
            return generate_latest(registry).decode()

        text = await anyio.to_thread.run_sync(in_thread)
        stores = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "hicache_stores_total"]
        assert stores[0].value == 4 and stores[0].labels == {"replica": "r1"}


async def test_the_admin_routes_attach_and_detach_with_a_token(tmp_path: Path) -> None:
    token = "t0k3n-for-the-test"
    async with HiCache.from_config(config([file_entry(tmp_path)])) as cache:
        async with serve(cache, port=0, admin=True, admin_token=token) as server:
            url = server.url
            status, _ = await anyio.to_thread.run_sync(fetch, url + "/admin/storage")
            assert status == 401
            entry = file_entry(tmp_path, "second")
            status, body = await anyio.to_thread.run_sync(
                lambda: fetch(url + "/admin/storage/attach", {"entry": entry, "position": 0}, token))
            assert status == 200 and json.loads(body)["chain"] == ["second", "disk"]
            status, body = await anyio.to_thread.run_sync(
                lambda: fetch(url + "/admin/storage/attach", {"entry": {"kind": "file", "name": "x", "fsync": "no"}}, token))
            assert status == 400 and "attach_storage" in json.loads(body)["error"]
            await cache.store(tokens_of(0), kv_of(0))
            status, body = await anyio.to_thread.run_sync(
                lambda: fetch(url + "/admin/storage/detach", {"name": "disk", "drain": True}, token))
            assert status == 200 and json.loads(body)["chain"] == ["second"]
            status, body = await anyio.to_thread.run_sync(lambda: fetch(url + "/admin/storage", None, token))
            assert json.loads(body) == {"storage": [{"name": "second", "kind": "file", "position": 0}]}
            status, _ = await anyio.to_thread.run_sync(lambda: fetch(url + "/admin/storage/detach", {"name": 3}, token))
            assert status == 400
            # The CLI client, as an operator would run it (the token from the environment).
            from hicache.metrics.admin_cli import main as admin_main

            entry_file = tmp_path / "third.yaml"
            entry_file.write_text(f"kind: file\nname: third\npath: {tmp_path / 'third'}\nfsync: never\n")
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("HICACHE_ADMIN_TOKEN", token)
                out = io.StringIO()
                mp.setattr("sys.stdout", out)
                code = await anyio.to_thread.run_sync(lambda: admin_main(["--url", url, "attach", str(entry_file)]))
            assert code == 0 and json.loads(out.getvalue())["chain"] == ["second", "third"]
        assert list(cache.stats().storage) == ["second", "third"]
    with pytest.raises(Exception, match="admin_token"):
        async with HiCache.from_config(config([])) as cache, serve(cache, port=0, host="0.0.0.0", admin=True):
            pass


async def test_engine_metrics_record_each_request() -> None:
    model = tiny_model()
    metrics = EngineMetrics()
    async with HiCache.from_config(lm_config(model, None)) as cache:
        async with Engine(CachedCausalLM(model, cache), max_running=2, on_result=metrics.observe) as engine:
            metrics.bind(engine)
            tokens = prompt(90, seed=1)
            first = await engine.generate(Request(tokens, max_new_tokens=4))
            second = await engine.generate(Request(tokens + list(first.output) + prompt(20, 2), 3))
    text = generate_latest(metrics.registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("hicache_engine_ttft_seconds_count", ())] == 2
    assert samples[("hicache_engine_itl_seconds_count", ())] == 3 + 2
    assert samples[("hicache_engine_queue_seconds_count", ())] == 2
    assert samples[("hicache_engine_cached_tokens_sum", ())] == first.cached_tokens + second.cached_tokens == 80
    assert samples[("hicache_engine_cached_tokens_by_tier_total", (("tier", "device"),))] == 80
    assert samples[("hicache_engine_requests_total", (("outcome", "finished"),))] == 2
    assert samples[("hicache_engine_ttft_seconds_sum", ())] == pytest.approx(first.ttft_s + second.ttft_s)


async def test_logs_as_json_lines_name_the_tier_and_the_numbers(tmp_path: Path) -> None:
    stream = io.StringIO()
    # Whatever other tests or libraries did to global logging (logging.disable, disabled loggers) is undone here.
    disabled_below = logging.root.manager.disable
    ours = [lg for name, lg in logging.root.manager.loggerDict.items()
            if name.startswith("hicache") and isinstance(lg, logging.Logger) and lg.disabled]
    logging.disable(logging.NOTSET)
    for lg in ours:
        lg.disabled = False
    configure("INFO", "json", 60.0, stream=stream)
    try:
        async with HiCache.from_config(config([file_entry(tmp_path)])) as cache:
            await cache.attach_storage(file_entry(tmp_path, "extra"))
            await cache.detach_storage("extra")
    finally:
        configure(None, None, 60.0)
        logging.getLogger("hicache").setLevel(logging.NOTSET)
        logging.disable(disabled_below)
        for lg in ours:
            lg.disabled = True
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    detached = [x for x in lines if "detached" in x["message"]]
    assert detached and detached[0]["logger"] == "hicache.controller.storage_chain" and detached[0]["level"] == "INFO"
    assert "extra (file)" in detached[0]["message"] and "chain now: disk" in detached[0]["message"]


def test_repeated_warnings_are_rate_limited_and_counted() -> None:
    logger = logging.getLogger("hicache.test.ratelimit")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        limited = RateLimited(logger, interval_s=0.2)
        for _ in range(50):
            limited.warning("checksum", "page failed (%s)", "checksum")
        limited.warning("magic", "page failed (%s)", "magic")
        import time

        time.sleep(0.25)
        limited.warning("checksum", "page failed (%s)", "checksum")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines == ["page failed (checksum)", "page failed (magic)",
                     "page failed (checksum) (49 more like it in the last 0.2 s not logged)"]


def test_the_docs_list_every_metric() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "operating.md").read_text(encoding="utf-8")
    for name, (kind, _, _) in METRICS.items():
        full = f"hicache_{name}" + ("_total" if kind == "counter" else "")
        assert f"`{full}`" in text, f"docs/operating.md's metric list lacks {full}"
