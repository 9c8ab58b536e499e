"""The connector's cache service closing: its drain writes what the write policy owes storage and
says, with counts, what it wrote and what it could not (no vLLM engine: the service alone).

Storage writes are slowed by a fake (``SlowWriteFileBackend``), so pages are still owed when the
service closes. With time enough every promised page reaches a file; with a ``shutdown_timeout_s``
too short, the files written plus the pages logged as not written are exactly the pages promised.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from anyio.from_thread import start_blocking_portal

from hicache import load_config
from hicache.integrations.vllm.service import CacheService

PAGE = 16
PAGES_PER_STORE = 4
STORES = 6


def _config(pages: Path, delay_s: float, shutdown_s: float):
    return load_config(overrides={
        "model": {"name": "drain-test", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "page_size": PAGE,
        "tiers": {
            "device": {"capacity": "4MiB", "device": "cpu"},
            "host": {"capacity": "4MiB"},
            "storage": [{"kind": "tests.vllm.fakes:SlowWriteFileBackend", "name": "file", "path": str(pages),
                         "fsync": "never", "delay_s": delay_s}],
        },
        "policies": {"write": "write_through"},
        "controller": {"shutdown_timeout_s": shutdown_s},
    }, env={})


def _close_after_a_burst(tmp_path: Path, delay_s: float, shutdown_s: float) -> tuple[CacheService, int, int]:
    """Store STORES prompts, close the service at once; (service, page files then, page files after)."""
    pages = tmp_path / "pages"
    config = _config(pages, delay_s, shutdown_s)
    n = PAGE * PAGES_PER_STORE
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(CacheService(config, str(tmp_path / "s.sock"))) as svc:
            for i in range(STORES):
                tokens = list(range(1000 * i + 1, 1000 * i + 1 + n))  # distinct prompts: nothing shared
                portal.call(svc.cache.store, tokens, torch.randn(2, 2, n, 2, 8))
            at_close = len(list(pages.rglob("*.kv")))
    return svc, at_close, len(list(pages.rglob("*.kv")))


def test_closing_drains_every_promised_page_to_storage_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.hicache")
    svc, at_close, after = _close_after_a_burst(tmp_path, delay_s=0.2, shutdown_s=20)
    promised = STORES * PAGES_PER_STORE
    assert at_close < promised, "the burst left no write pending: the test proves nothing"
    assert after == promised
    assert svc.counters.undrained_pages == 0
    assert svc.counters.drained_pages == promised - at_close
    assert f"{promised - at_close} pages written to storage while draining" in caplog.text
    assert "0 pages the write_through policy promised to storage not written" in caplog.text


def test_a_drain_cut_short_counts_every_page_it_could_not_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.hicache")
    svc, _, after = _close_after_a_burst(tmp_path, delay_s=1.5, shutdown_s=0.5)
    promised = STORES * PAGES_PER_STORE
    lost = svc.counters.undrained_pages
    assert lost > 0
    assert after + lost == promised  # nothing unaccounted for
    assert f"{lost} pages the write_through policy promised to storage not written" in caplog.text
