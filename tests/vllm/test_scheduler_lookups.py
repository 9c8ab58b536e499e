"""The scheduler half's lookups against a real worker service over the real channel (no engine).

A request scheduled by the first ``schedule()`` after it arrived is answered by its queued lookup
(one round trip a request, not two); once a step has been planned the answer is stale and the
scheduler asks again, so pages saved meanwhile count. Imports vLLM's connector base (the metadata
class), not its engine.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal

from hicache import load_config
from hicache.integrations.vllm.channel import ChannelClient, socket_path
from hicache.integrations.vllm.service import CacheService

from ..conftest import make_kv, make_tokens

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations); the suite makes warnings errors
    warnings.simplefilter("ignore")
    from hicache.integrations.vllm.scheduler_side import SchedulerSide

BLOCK, PAGE = 8, 4


def _request(req_id: str, tokens: list[int]) -> Any:
    """The fields of vLLM's ``Request`` the scheduler side reads."""
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens, num_tokens=len(tokens))


def _no_step() -> Any:
    """A ``SchedulerOutput`` that schedules nothing (the fields the scheduler side reads)."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=cached)


def test_a_request_scheduled_at_once_reuses_its_queued_lookup_and_a_waiting_one_asks_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    config = load_config(overrides={
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "page_size": PAGE, "tiers": {"device": {"capacity": "64KiB", "device": "cpu"}, "host": {"capacity": "64KiB"}},
    }, env={})
    path = socket_path("engine-lookups")
    tokens = make_tokens(41)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(CacheService(config, path)) as service:
        client = ChannelClient(path, timeout_s=5)
        side = SchedulerSide(client, PAGE, BLOCK)
        portal.call(service.cache.store, tokens[:16], make_kv(config, 16))

        a = _request("a", tokens)
        side.on_new_request(a)
        assert service.counters.lookups == 1
        assert side.get_num_new_matched_tokens(a, 0) == (16, False)  # 2 blocks, from the queued answer
        assert service.counters.lookups == 1 and side.profile.calls["lookup_reused"] == 1
        # Asked again (vLLM retries a request it could not allocate for): used once only, a fresh lookup.
        assert side.get_num_new_matched_tokens(a, 8) == (8, False)
        assert service.counters.lookups == 2

        # b arrives, a step is planned before b is scheduled, and more of its prefix is saved meanwhile:
        # the queued answer (2 blocks) is stale, the scheduler asks again and finds 4.
        b = _request("b", tokens)
        side.on_new_request(b)
        side.build_meta(_no_step())
        portal.call(service.cache.store, tokens[:32], make_kv(config, 32))
        assert side.get_num_new_matched_tokens(b, 0) == (32, False)
        assert service.counters.lookups == 4 and side.profile.calls["lookup_reused"] == 1

        # A request that finishes before it is scheduled leaves no answer behind.
        c = _request("c", tokens)
        side.on_new_request(c)
        side.request_finished(c)
        assert "c" not in side._queued
        client.close()
