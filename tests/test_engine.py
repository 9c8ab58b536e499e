"""The reference engine with a real tiny model: limits, admission, cancellation, failures, shutdown."""

from __future__ import annotations

import inspect
from typing import Any

import anyio
import pytest
import torch

from hicache import (
    EngineClosedError,
    EngineOverloadedError,
    HiCache,
    RequestCancelledError,
)
from hicache.engine import Engine, Request
from hicache.integrations.transformers import CachedCausalLM, ComputeGate

from .helpers import assert_consistent
from .lm_helpers import full_prefill_logits, greedy, lm_config, prompt, tiny_model

MODEL = tiny_model()


class FailingModel(torch.nn.Module):
    """Fault injection: the tiny model, except that a forward over ``poison`` raises."""

    def __init__(self, model: Any, poison: int) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.poison = poison
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.x / 4.5x

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, input_ids: torch.Tensor, cache: Any = None, use_cache: bool = True, logits_to_keep: int = 0):
        if self.poison in input_ids.tolist()[0]:
            raise RuntimeError("injected model failure")
        kwargs = {self.cache_kw: cache, "use_cache": use_cache, "logits_to_keep": logits_to_keep}
        return self.inner(input_ids=input_ids, **kwargs)


def overlaps(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


async def test_requests_are_served_with_the_reference_answers() -> None:
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        async with Engine(CachedCausalLM(MODEL, cache), max_running=2) as engine:
            tokens = prompt(90, seed=1)
            first = await engine.generate(Request(tokens, max_new_tokens=6))
            second = await engine.generate(Request(tokens + list(first.output) + prompt(20, 2), 3))
    assert list(first.output) == greedy(MODEL, tokens, 6)
    assert first.cached_tokens == 0 and second.cached_tokens == 80  # 90 + 5 computed tokens: 5 full pages
    assert second.by_tier["device"] == 80
    assert len(first.token_times) == 6 and len(first.itl_s) == 5 and all(x >= 0 for x in first.itl_s)
    assert 0 <= first.queue_s <= first.ttft_s and first.prefill_s > 0


async def test_no_more_than_max_running_requests_run_at_once() -> None:
    async with Engine(CachedCausalLM(MODEL, None), max_running=2) as engine:
        handles = [await engine.submit(Request(prompt(40, i), 5)) for i in range(6)]
        done = [await h.result() for h in handles]
    assert overlaps([(r.admitted_s, r.finished_s) for r in done]) == 2
    assert engine.stats().finished == 6


async def test_admission_keeps_the_running_requests_kv_within_budget() -> None:
    async with Engine(CachedCausalLM(MODEL, None), max_running=4, max_kv_tokens=100) as engine:
        handles = [await engine.submit(Request(prompt(60, i), 5)) for i in range(4)]
        done = [await h.result() for h in handles]
    assert overlaps([(r.admitted_s, r.finished_s) for r in done]) == 1  # 65 + 65 > 100: one at a time


async def test_a_cancelled_waiting_request_never_runs() -> None:
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        async with Engine(CachedCausalLM(MODEL, cache), max_running=1) as engine:
            handles = [await engine.submit(Request(prompt(60, i), 8)) for i in range(3)]
            handles[2].cancel()
            with pytest.raises(RequestCancelledError):
                await handles[2].result()
            await handles[1].result()
        assert engine.stats().cancelled == 1 and engine.stats().finished == 2
        assert cache.stats().retrieves == 2  # the cancelled one never reached the cache
        await cache.wait_idle()
        assert_consistent(cache)


async def test_a_cancelled_running_request_releases_its_lease() -> None:
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache)
        tokens = prompt(120, seed=3)
        async with Engine(lm) as engine:
            await engine.generate(Request(tokens[:100], 2))
            handle = await engine.submit(Request(tokens, 200))
            while not engine.stats().running:
                await anyio.sleep(0.001)
            await anyio.sleep(0.05)
            handle.cancel()
            with pytest.raises(RequestCancelledError):
                await handle.result()
            again = await engine.generate(Request(tokens, 2))
        assert again.cached_tokens == 112  # the prompt's pages were stored right after its prefill
        await cache.wait_idle()
        assert_consistent(cache)


async def test_cancelling_the_caller_of_generate_cancels_the_request() -> None:
    async with Engine(CachedCausalLM(MODEL, None), max_running=1) as engine:
        with anyio.move_on_after(0.02):
            await engine.generate(Request(prompt(50, 1), 500))
        while engine.stats().running:
            await anyio.sleep(0.01)
        assert engine.stats().cancelled == 1


async def test_a_failing_request_fails_alone() -> None:
    poison = 777
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        async with Engine(CachedCausalLM(FailingModel(MODEL, poison), cache), max_running=2) as engine:
            bad = await engine.submit(Request(prompt(40, 1) + [poison], 4))
            good = await engine.submit(Request(prompt(40, 2), 4))
            with pytest.raises(RuntimeError, match="injected"):
                await bad.result()
            assert list((await good.result()).output) == greedy(MODEL, prompt(40, 2), 4)
        assert engine.stats().failed == 1 and engine.stats().finished == 1
        await cache.wait_idle()
        assert_consistent(cache)


async def test_leaving_the_block_drains_what_was_submitted() -> None:
    async with Engine(CachedCausalLM(MODEL, None), max_running=1) as engine:
        handles = [await engine.submit(Request(prompt(40, i), 4)) for i in range(3)]
    assert all(h.done for h in handles)
    assert [len((await h.result()).output) for h in handles] == [4, 4, 4]
    with pytest.raises(EngineClosedError):
        await engine.submit(Request(prompt(10, 0), 1))


async def test_a_shutdown_past_its_deadline_cancels_what_is_left() -> None:
    async with Engine(CachedCausalLM(MODEL, None), max_running=1, shutdown_timeout_s=0.2) as engine:
        handles = [await engine.submit(Request(prompt(40, i), 100_000)) for i in range(2)]
    for h in handles:
        with pytest.raises(RequestCancelledError):
            await h.result()
    assert engine.stats().cancelled == 2


async def test_a_full_waiting_queue_refuses_more() -> None:
    async with Engine(CachedCausalLM(MODEL, None), max_running=1, max_waiting=1) as engine:
        first = await engine.submit(Request(prompt(40, 1), 50))
        while not engine.stats().running:
            await anyio.sleep(0.001)
        await engine.submit(Request(prompt(40, 2), 1))
        with pytest.raises(EngineOverloadedError):
            await engine.submit(Request(prompt(40, 3), 1))
        first.cancel()


async def test_the_engine_restores_what_the_cache_holds() -> None:
    tokens = prompt(200, seed=9)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache)
        async with Engine(lm) as engine:
            await engine.generate(Request(tokens[:150], 1))
            async with lm.sequence(tokens) as seq:
                await seq.prefill()
    assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)


async def test_the_compute_gate_serves_prefills_before_decode_steps() -> None:
    gate = ComputeGate()
    order: list[str] = []

    async def step(name: str, priority: int) -> None:
        async with gate.hold(priority):
            order.append(name)

    async with anyio.create_task_group() as tg:
        async with gate.hold(ComputeGate.DECODE):
            tg.start_soon(step, "decode-1", ComputeGate.DECODE)
            await anyio.sleep(0.01)
            tg.start_soon(step, "prefill-1", ComputeGate.PREFILL)
            await anyio.sleep(0.01)
            tg.start_soon(step, "decode-2", ComputeGate.DECODE)
            await anyio.sleep(0.01)
            tg.start_soon(step, "prefill-2", ComputeGate.PREFILL)
            await anyio.sleep(0.01)
            assert gate.waiting == 4
    assert order == ["prefill-1", "prefill-2", "decode-1", "decode-2"]


async def test_a_cancelled_waiter_does_not_block_the_gate() -> None:
    gate = ComputeGate()
    served: list[str] = []

    async def step(name: str) -> None:
        async with gate.hold(ComputeGate.DECODE):
            served.append(name)

    async with anyio.create_task_group() as tg:
        async with gate.hold(ComputeGate.PREFILL):
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(step, "cancelled")
                await anyio.sleep(0.01)
                tg.start_soon(step, "kept")
                await anyio.sleep(0.01)
                assert gate.waiting == 2
                doomed.cancel_scope.cancel()
            assert gate.waiting == 1
    assert served == ["kept"]
    async with gate.hold(ComputeGate.PREFILL):  # free again
        pass


async def test_wait_no_prefill_returns_once_no_prefill_holds_the_gate() -> None:
    gate = ComputeGate()
    await gate.wait_no_prefill()  # free: at once
    async with gate.hold(ComputeGate.DECODE):
        await gate.wait_no_prefill()  # a decode step does not hold background work back
    passed: list[str] = []

    async def background() -> None:
        await gate.wait_no_prefill()
        passed.append("background")

    async def decode() -> None:
        async with gate.hold(ComputeGate.DECODE):
            passed.append("decode")

    async with anyio.create_task_group() as tg:
        async with gate.hold(ComputeGate.PREFILL):
            assert gate.prefill_running
            tg.start_soon(background)
            tg.start_soon(decode)
            await anyio.sleep(0.02)
            assert passed == []  # both wait for the prefill
    assert sorted(passed) == ["background", "decode"] and not gate.prefill_running


async def test_backups_wait_while_a_prefill_holds_the_gate_but_not_forever() -> None:
    tokens = prompt(64, seed=30)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache)  # hands its gate to the cache
        assert cache.controller.yield_to_compute == lm.gate.wait_no_prefill
        async with lm.gate.hold(ComputeGate.PREFILL):
            kv = torch.zeros(2, 2, 64, 2, 16)
            await cache.store(tokens, kv)
            await anyio.sleep(0.2)
            assert cache.stats().backups == 0  # queued behind the prefill
        await cache.wait_idle()
        assert cache.stats().backups == 4
        cache.controller.yield_max_s = 0.05  # bounded: a prefill that never ends does not starve them
        other = prompt(64, seed=31)
        async with lm.gate.hold(ComputeGate.PREFILL):
            await cache.store(other, kv)
            with anyio.fail_after(5):
                await cache.wait_idle()
        assert cache.stats().backups == 8
    # Without yielding (yield_to_prefills=False), backups run at once.
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache, yield_to_prefills=False)
        async with lm.gate.hold(ComputeGate.PREFILL):
            await cache.store(tokens, torch.zeros(2, 2, 64, 2, 16))
            with anyio.fail_after(5):
                await cache.wait_idle()
            assert cache.stats().backups == 4


async def test_closing_the_cache_while_its_backups_wait_for_a_prefill_loses_nothing(tmp_path) -> None:
    gate = ComputeGate()
    tokens = prompt(64, seed=32)
    async with gate.hold(ComputeGate.PREFILL):  # a prefill that outlives the cache
        with anyio.fail_after(10):
            async with HiCache.from_config(lm_config(MODEL, tmp_path / "pages")) as cache:
                CachedCausalLM(MODEL, cache, gate=gate)
                await cache.store(tokens, torch.zeros(2, 2, 64, 2, 16))
                await anyio.sleep(0.05)
                assert cache.stats().backups == 0  # waiting for the prefill
        # The shutdown drain still backs the pages up and writes them (after yield_max_s at most).
        stats = cache.controller.counters
        assert stats.backups == 4 and stats.storage_backups == 4
        assert sum(stats.lost_pages.values()) == 0
        assert_consistent(cache)
