"""Prefill/decode hand-offs between two vLLM connector services (``handoff.py``), without vLLM.

Two real caches, each in its own ``CacheService`` (the connector worker's loop and channel), share
a real folder as their storage tier: the producer hands a prompt off over its channel, exactly as
the connector's scheduler does, and the consumer watches for it and copies it in. What vLLM adds
around this (blocks, ``WAITING_FOR_REMOTE_KVS``) is tested with two ``vllm serve`` processes in
``tests/vllm/test_vllm_pd.py``; here every outcome that does not need vLLM: the pages arrive bit
for bit, a consumer of another namespace is refused (and gets nothing even with a forged check),
a flushed tier, a failing or stalled producer and an aborted request all end within their bounds,
counted, never as an error, and a producer that gives up says so, so its consumer stops waiting;
one that cannot say so (killed) falls silent, and its consumer stops waiting all the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from anyio.from_thread import start_blocking_portal

from hicache import load_config
from hicache.containers import namespace_from_config
from hicache.integrations.vllm.channel import ChannelClient, socket_path
from hicache.integrations.vllm import handoff
from hicache.integrations.vllm.handoff import notice_key, page_check, pulse_key
from hicache.integrations.vllm.service import CacheService
from hicache.integrations.vllm.settings import ConnectorOptions, PDOptions
from hicache.tiers.storage.page_format import HEADER_BYTES

from .conftest import make_kv, make_tokens

PS = 4


@dataclass(frozen=True)
class ReceiveSpec:
    """``metadata.ReceiveSpec``'s fields (that module imports vLLM, which this environment lacks)."""

    req_id: str
    tokens: list[int]
    first_page: int
    end_page: int
    block_ids: tuple[list[int], ...]


def _config(
    storage: list[dict[str, Any]], tenant_salt: str = "", tenant_key: str | None = None, **model: Any
) -> Any:
    return load_config(overrides={
        "tenant_salt": tenant_salt,
        "tenant_key": tenant_key,
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", **model},
        "page_size": PS,
        "tiers": {"device": {"capacity": "64KiB", "device": "cpu"}, "host": {"capacity": "64KiB"}, "storage": storage},
        "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
        "controller": {"shutdown_timeout_s": 1.0},
    }, env={})


def _options(send_s: float = 5.0, receive_s: float = 5.0) -> ConnectorOptions:
    return ConnectorOptions(stats_interval_s=0, pd=PDOptions(send_timeout_s=send_s, receive_timeout_s=receive_s))


class Copied:
    """A consumer's ``copy_in`` that reads what it is given, as the worker copies it into vLLM's blocks:
    every layer of the held pages, by token page."""

    def __init__(self) -> None:
        self.pages: dict[int, list[torch.Tensor]] = {}

    def __call__(self, block_ids: tuple[list[int], ...], first_page: int, segments: list[tuple[Any, list[int]]],
                 thin: tuple[tuple[int, int], ...] = ()) -> int:
        page = first_page
        for tier, pages in segments:
            for p in pages:
                self.pages[page] = [tier.layer_view(layer)[p].clone() for layer in range(2)]
                page += 1
        return page - first_page


def _page_kv(kv: torch.Tensor, page: int) -> list[torch.Tensor]:
    """``kv`` ``[C, L, T, H, D]``, page ``page`` of each layer as a host page holds it ``[C, ps * H * D]``."""
    chunk = kv[:, :, page * PS : (page + 1) * PS]
    return [chunk[:, layer].reshape(chunk.shape[0], -1) for layer in range(kv.shape[1])]


def _assert_bit_for_bit(copied: Any, kv: torch.Tensor) -> None:
    """Every page copied into vLLM's blocks equals the producer's KV of that page, every layer."""
    for page, layers in copied.pages.items():
        for got, want in zip(layers, _page_kv(kv, page), strict=True):
            assert torch.equal(got, want)

def _fault_over_folder(fake: str, folder: Path, **options: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The producer's tier (fault fake ``fake`` of ``tests/fakes.py`` over a shared folder) and the
    consumer's (the same folder, plain)."""
    inner = {"kind": "file", "path": str(folder)}
    return ([{"kind": f"tests.fakes:{fake}", "name": "shared", **options, "inner": inner}],
            [{**inner, "name": "shared"}])



def _wait(fn: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("not within the bound")


def _received(service: CacheService) -> list[Any]:
    return _wait(lambda: service.handoffs.take(set())[1])


@contextmanager
def _pair(producer_cfg: Any, consumer_cfg: Any, send_s: float, receive_s: float) -> Iterator[tuple[Any, Any, Any]]:
    """A portal, a producer ``CacheService`` (``send_s``) and a consumer (``receive_s``), started."""
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(
                CacheService(producer_cfg, socket_path("p"), _options(send_s=send_s))) as producer, \
                portal.wrap_async_context_manager(
                    CacheService(consumer_cfg, socket_path("d"), _options(receive_s=receive_s))) as consumer:
            yield portal, producer, consumer


def _hand_off(portal: Any, producer: Any, consumer: Any, req_id: str, tokens: list[int],
              handoff_id: str) -> tuple[dict[str, Any], Any, Copied]:
    """The whole of ``tokens`` handed off as the scheduler does it (the producer's reply passed to
    the consumer), received into vLLM blocks 0..: (the reply, the receive's outcome, what was copied)."""
    handed = portal.call(producer.handoffs.handoff, req_id, tokens, handoff_id)
    assert handed["tokens"] == len(tokens)
    assert portal.call(consumer.handoffs.expect, req_id, tokens, len(tokens), [handed["check"]], 0, handoff_id,
                       handed.get("pulse_s"))
    pages = len(tokens) // PS
    copied = Copied()
    portal.call(consumer.begin_receives, [ReceiveSpec(req_id, tokens, 0, pages, (list(range(pages)),))], copied)
    (outcome,) = _received(consumer)
    return handed, outcome, copied



def test_a_prompt_handed_off_through_a_shared_folder_arrives_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    shared = [{"kind": "file", "path": str(tmp_path / "shared"), "name": "shared"}]
    tokens = make_tokens(9 * PS + 2)
    producer_cfg = _config(shared)
    kv = make_kv(producer_cfg, 9 * PS)
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(CacheService(producer_cfg, socket_path("p"), _options())) as producer, \
                portal.wrap_async_context_manager(CacheService(_config(shared), socket_path("d"), _options())) as consumer:
            portal.call(producer.cache.store, tokens[: 9 * PS], kv)
            to_producer, to_consumer = ChannelClient(socket_path("p")), ChannelClient(socket_path("d"))
            reply = to_producer.call({"op": "handoff", "req": "r1", "tokens": tokens[: 9 * PS + 1]})
            assert reply is not None and reply["tokens"] == 9 * PS and len(reply["check"]) == 32
            # Sent is reported only for a request vLLM has said finished (get_finished's contract).
            time.sleep(0.3)
            assert producer.handoffs.take(set())[0] == set()
            assert _wait(lambda: producer.handoffs.take({"r1"})[0]) == {"r1"}
            assert producer.counters.pd_sends == 1 and producer.counters.pd_sent_tokens == 9 * PS
            # The consumer: the queued lookup carries the hand-off; 8 pages are to come (one token left).
            reply = to_consumer.call({"op": "lookup", "req": "r1", "tokens": tokens[: 9 * PS], "prefetch": True,
                                      "expect": {"tokens": 8 * PS, "checks": [reply["check"]]}})
            assert reply is not None and reply["expect"] is True
            copied = Copied()
            spec = ReceiveSpec("r1", tokens[: 8 * PS], 2, 8, (list(range(8)),))  # vLLM holds pages 0-1 itself
            portal.call(consumer.begin_receives, [spec], copied)
            (outcome,) = _received(consumer)
            assert outcome.spec is spec and outcome.from_page == 8  # everything arrived
            assert sorted(copied.pages) == list(range(2, 8))  # only what vLLM lacked
            _assert_bit_for_bit(copied, kv)
            c = consumer.counters
            assert (c.pd_receives, c.pd_received_tokens, c.pd_receive_failures) == (1, 6 * PS, 0)
            assert consumer.records["r1"]["loaded_tokens"] == 6 * PS and consumer.records["r1"]["failed_tokens"] == 0
            to_producer.close()
            to_consumer.close()


def test_a_write_the_tier_refuses_for_a_moment_is_written_again_within_the_send_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    cfg = _config([{"kind": "tests.fakes:FailingFirstCallsStorageBackend", "name": "shared", "inner": {"kind": "memory"},
                    "write_failures": 2}])
    tokens = make_tokens(3 * PS + 1)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(
            CacheService(cfg, socket_path("p"), _options(send_s=5.0))) as producer:
        portal.call(producer.cache.store, tokens[: 3 * PS], make_kv(cfg, 3 * PS))
        started = time.monotonic()
        assert portal.call(producer.handoffs.handoff, "r1", tokens)["tokens"] == 3 * PS
        assert _wait(lambda: producer.handoffs.take({"r1"})[0]) == {"r1"}
        assert time.monotonic() - started < 4  # after a short back-off, not at the send bound
        c = producer.counters
        assert (c.pd_sends, c.pd_send_failures, c.pd_sent_tokens) == (1, 0, 3 * PS)
        assert producer.cache.controller.storage[0].backend.set_calls >= 3


def test_a_read_that_fails_is_read_again_within_the_receive_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pages are in the shared tier, but the consumer's first reads of them fail (a transfer
    # that timed out): they are read again, and the receive is whole, not recomputed.
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    folder = {"kind": "file", "path": str(tmp_path / "shared")}
    tokens = make_tokens(4 * PS + 1)
    producer_cfg = _config([{**folder, "name": "shared"}])
    kv = make_kv(producer_cfg, 4 * PS)
    flaky = [{"kind": "tests.fakes:FailingFirstCallsStorageBackend", "name": "shared", "inner": folder,
              "read_failures": 2}]
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(CacheService(producer_cfg, socket_path("p"), _options())) as producer, \
                portal.wrap_async_context_manager(CacheService(_config(flaky), socket_path("d"), _options())) as consumer:
            portal.call(producer.cache.store, tokens[: 4 * PS], kv)
            handed = portal.call(producer.handoffs.handoff, "r1", tokens)
            assert _wait(lambda: producer.handoffs.take({"r1"})[0]) == {"r1"}
            assert portal.call(consumer.handoffs.expect, "r1", tokens[: 4 * PS], 4 * PS, [handed["check"]], 0)
            copied = Copied()
            started = time.monotonic()
            portal.call(consumer.begin_receives, [ReceiveSpec("r1", tokens[: 4 * PS], 0, 4, (list(range(4)),))], copied)
            (outcome,) = _received(consumer)
            assert outcome.from_page == 4 and sorted(copied.pages) == list(range(4))  # whole
            _assert_bit_for_bit(copied, kv)
            c = consumer.counters
            assert (c.pd_receives, c.pd_receive_failures) == (1, 0)
            assert c.pd_receive_retries >= 1
            assert consumer.cache.controller.storage[0].backend.get_calls >= 3
            assert time.monotonic() - started < 4  # well within receive_timeout_s (5)


@pytest.mark.parametrize("differs", [{"tenant_salt": "another-tenant"}, {"revision": "other-weights"}])
def test_a_consumer_of_another_namespace_is_refused_and_gets_nothing_even_with_a_forged_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, differs: dict[str, str]
) -> None:
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    shared = [{"kind": "file", "path": str(tmp_path / "shared"), "name": "shared"}]
    tokens = make_tokens(6 * PS)
    producer_cfg = _config(shared)
    consumer_cfg = _config(shared, **differs)
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(CacheService(producer_cfg, socket_path("p"), _options())) as producer, \
                portal.wrap_async_context_manager(
                    CacheService(consumer_cfg, socket_path("d"), _options(receive_s=0.5))) as consumer:
            portal.call(producer.cache.store, tokens, make_kv(producer_cfg, len(tokens)))
            handed = portal.call(producer.handoffs.handoff, "r1", tokens)
            _wait(lambda: producer.handoffs.take({"r1"})[0])
            assert not portal.call(consumer.handoffs.expect, "r1", tokens, 4 * PS, [handed["check"]], 0)
            assert consumer.counters.pd_receives_refused == 1
            # A check forged to match this consumer: the pages still cannot be found under its keys.
            forged = page_check(consumer.cache.controller.tree.seed, tokens, PS)
            assert forged != handed["check"]
            assert portal.call(consumer.handoffs.expect, "r2", tokens, 4 * PS, [forged], 0)
            copied = Copied()
            portal.call(consumer.begin_receives, [ReceiveSpec("r2", tokens[: 4 * PS], 0, 4, (list(range(4)),))], copied)
            (outcome,) = _received(consumer)
            assert outcome.from_page == 0 and copied.pages == {}  # nothing: vLLM computes it all
            assert consumer.counters.pd_receive_failures == 1 and consumer.counters.pd_received_tokens == 0


def test_a_flushed_tier_a_failing_or_stalled_producer_and_an_aborted_request_end_within_their_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    folder = tmp_path / "shared"
    shared = [{"kind": "file", "path": str(folder), "name": "shared"}]
    tokens = make_tokens(4 * PS + 1)
    cfg = _config(shared)
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(CacheService(cfg, socket_path("p"), _options())) as producer, \
                portal.wrap_async_context_manager(
                    CacheService(_config(shared), socket_path("d"), _options(receive_s=0.5))) as consumer:
            portal.call(producer.cache.store, tokens[: 4 * PS], make_kv(cfg, 4 * PS))
            handed = portal.call(producer.handoffs.handoff, "r1", tokens)
            _wait(lambda: producer.handoffs.take({"r1"})[0])
            for page in folder.rglob("*.kv"):  # the shared tier flushed between prefill and decode
                page.unlink()
            assert portal.call(consumer.handoffs.expect, "r1", tokens[: 4 * PS], 4 * PS, [handed["check"]], 0)
            started = time.monotonic()
            copied = Copied()
            portal.call(consumer.begin_receives, [ReceiveSpec("r1", tokens[: 4 * PS], 0, 4, (list(range(4)),))], copied)
            (outcome,) = _received(consumer)
            assert outcome.from_page == 0 and copied.pages == {}
            assert 0.4 < time.monotonic() - started < 5  # its receive_timeout_s, then vLLM recomputes
            # An aborted request ends its receive at once (its blocks are freed after it is reported).
            assert portal.call(consumer.handoffs.expect, "r2", tokens[: 4 * PS], 4 * PS, [handed["check"]], 0)
            portal.call(consumer.handoffs.forget, "r2")
            portal.call(consumer.begin_receives, [ReceiveSpec("r2", tokens[: 4 * PS], 0, 4, (list(range(4)),))], copied)
            (outcome,) = _received(consumer)
            assert outcome.spec.req_id == "r2" and outcome.from_page == 0
            assert consumer.counters.pd_receive_failures == 2

    for kind, bound in (("tests.fakes:FailingStorageBackend", 5.0), ("tests.fakes:StallingStorageBackend", 5.0)):
        cfg = _config([{"kind": kind, "name": "shared"}])
        with start_blocking_portal() as portal, portal.wrap_async_context_manager(
                CacheService(cfg, socket_path("p2"), _options(send_s=0.5))) as producer:
            portal.call(producer.cache.store, tokens[: 4 * PS], make_kv(cfg, 4 * PS))
            started = time.monotonic()
            handed = portal.call(producer.handoffs.handoff, "r1", tokens)
            assert handed["tokens"] == 4 * PS  # held in memory: promised; the write decides
            assert _wait(lambda: producer.handoffs.take({"r1"})[0]) == {"r1"}  # reported, so vLLM frees the blocks
            assert time.monotonic() - started < bound
            assert producer.counters.pd_send_failures == 1 and producer.counters.pd_sends == 0


def test_a_producer_that_gives_up_says_so_and_its_consumer_stops_waiting_with_what_arrived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    folder = tmp_path / "shared"
    # The producer's store takes two pages of the prompt, then refuses the rest (out of room).
    refusing, shared = _fault_over_folder("PageRefusingStorageBackend", folder, accept_pages=2)
    tokens = make_tokens(4 * PS + 1)
    cfg = _config(refusing)
    kv = make_kv(cfg, 4 * PS)
    with _pair(cfg, _config(shared), send_s=1.0, receive_s=30.0) as (portal, producer, consumer):
        portal.call(producer.cache.store, tokens[: 4 * PS], kv)
        started = time.monotonic()
        _, outcome, copied = _hand_off(portal, producer, consumer, "r1", tokens[: 4 * PS], "h-1")
        # Far inside its 30 s bound: the producer's send bound (1 s), then at most a notice poll.
        assert time.monotonic() - started < 5
        assert outcome.from_page == 2 and sorted(copied.pages) == [0, 1]  # what arrived is used, bit for bit
        _assert_bit_for_bit(copied, kv)
        p, c = producer.counters, consumer.counters
        assert (p.pd_send_failures, p.pd_gave_up_notices) == (1, 1)
        assert (c.pd_receives_given_up, c.pd_receive_failures, c.pd_received_tokens) == (1, 1, 2 * PS)
        # The marker was read once and removed: the folder holds the two pages and nothing else.
        assert sorted(f.stat().st_size > HEADER_BYTES for f in folder.rglob("*.kv")) == [True, True]
        # Another hand-off id names another marker: a later hand-off of the same prompt is not cut short.
        seed = consumer.cache.controller.tree.seed
        assert notice_key(seed, tokens[: 4 * PS], PS, "h-1") != notice_key(seed, tokens[: 4 * PS], PS, "h-2")
        # Another tenant cannot name (or forge) this namespace's marker.
        assert notice_key(seed, tokens[: 4 * PS], PS, "h-1") != notice_key(
            seed[::-1], tokens[: 4 * PS], PS, "h-1")


def test_a_slow_producer_keeps_its_consumer_waiting_with_its_pulse_and_a_silent_one_is_given_up_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that cannot leave the gave-up marker (killed) falls silent: its consumer stops
    waiting after ``SILENT_BEATS`` pulse periods, far inside its bound; one whose send is slow but
    alive keeps pulsing, and its consumer waits for every page."""
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(handoff, "PULSE_S", 0.2)  # the producer's period, which its reply advertises
    folder = tmp_path / "shared"
    # Writing the prompt's pages takes 2 s (0.5 s a page); markers and pulses go through at once.
    slow, shared = _fault_over_folder("PageDelayingStorageBackend", folder, per_page_s=0.5)
    tokens = make_tokens(4 * PS + 1)
    cfg = _config(slow)
    kv = make_kv(cfg, 4 * PS)
    with _pair(cfg, _config(shared), send_s=20.0, receive_s=30.0) as (portal, producer, consumer):
        portal.call(producer.cache.store, tokens[: 4 * PS], kv)
        started = time.monotonic()
        handed, outcome, copied = _hand_off(portal, producer, consumer, "r1", tokens[: 4 * PS], "h-1")
        assert handed["pulse_s"] == 0.2
        # Silence is confirmed at the second unheard check, 1 s in; the send takes 2 s:
        # only the pulse kept the consumer waiting.
        assert time.monotonic() - started > 1.5
        assert outcome.from_page == 4 and sorted(copied.pages) == [0, 1, 2, 3]
        _assert_bit_for_bit(copied, kv)
        assert consumer.counters.pd_receives == 1 and consumer.counters.pd_receives_producer_silent == 0
        _wait(lambda: producer.handoffs.take({"r1"})[0])
        assert producer.counters.pd_sends == 1
        # The send over, its pulses are removed: the folder holds the four pages and nothing else.
        _wait(lambda: sorted(f.stat().st_size > HEADER_BYTES for f in folder.rglob("*.kv")) == [True] * 4)

        # A producer killed after it answered (its response reached the decode server), with two
        # of four pages of another prompt written: no marker, no pulse. Its consumer copies
        # what arrived and stops waiting after the silent periods, not after its 30 s bound.
        other = make_tokens(4 * PS + 1, seed=7)
        portal.call(producer.cache.store, other[: 2 * PS], make_kv(cfg, 2 * PS))
        portal.call(producer.cache.persist, other[: 2 * PS])
        check = page_check(consumer.cache.controller.tree.seed, other[: 4 * PS], PS, "h-2", 0.2)
        started = time.monotonic()
        assert portal.call(consumer.handoffs.expect, "r2", other[: 4 * PS], 4 * PS, [check], 0, "h-2", 0.2)
        copied = Copied()
        portal.call(consumer.begin_receives, [ReceiveSpec("r2", other[: 4 * PS], 0, 4, (list(range(4)),))], copied)
        (outcome,) = _received(consumer)
        waited = time.monotonic() - started
        assert 0.8 < waited < 5, waited
        assert outcome.from_page == 2 and sorted(copied.pages) == [0, 1]
        c = consumer.counters
        assert (c.pd_receives_producer_silent, c.pd_receives_given_up, c.pd_receive_failures) == (1, 0, 1)
        # A pulse is named from the marker's name: another hand-off or tenant cannot name it.
        seed = consumer.cache.controller.tree.seed
        mark = notice_key(seed, other[: 4 * PS], PS, "h-2")
        assert mark is not None
        assert pulse_key(mark, 1) != pulse_key(mark, 2)
        assert pulse_key(mark, 1) != pulse_key(notice_key(seed, other[: 4 * PS], PS, "h-3") or b"", 1)


def test_one_unheard_pulse_check_does_not_end_a_live_producers_hand_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``exists`` reads 0 when the store fails, so one failed pulse check looks like silence: it
    takes two unheard checks in a row to stop waiting, and a live producer's pages all arrive."""
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(handoff, "PULSE_S", 0.2)
    folder = tmp_path / "shared"
    slow, _ = _fault_over_folder("PageDelayingStorageBackend", folder, per_page_s=0.5)  # a 2 s send
    # The consumer's store is unreachable for the reads of one whole pulse check (whichever
    # check comes first: the pulses it asks for depend on when it runs): that check is unheard.
    blinking = [{"kind": "tests.fakes:ExistsOutageStorageBackend", "name": "shared",
                 "outage_reads": handoff.SILENT_BEATS + 1, "inner": {"kind": "file", "path": str(folder)}}]
    tokens = make_tokens(4 * PS + 1)
    cfg = _config(slow)
    kv = make_kv(cfg, 4 * PS)
    with _pair(cfg, _config(blinking), send_s=20.0, receive_s=30.0) as (portal, producer, consumer):
        portal.call(producer.cache.store, tokens[: 4 * PS], kv)
        tier = consumer.cache.controller.storage[0]
        mark = notice_key(consumer.cache.controller.tree.seed, tokens[: 4 * PS], PS, "h-1")
        assert mark is not None
        pulses = tier.codec.storage_keys([pulse_key(mark, b) for b in range(1, 100)])
        tier.backend.watched = set(pulses)
        _, outcome, copied = _hand_off(portal, producer, consumer, "r1", tokens[: 4 * PS], "h-1")
        # One whole check was unheard: the reads of four pulses in a row failed.
        assert tier.backend.failed_reads == handoff.SILENT_BEATS + 1
        failed = [pulses.index(k) for k in tier.backend.failed]
        assert failed == list(range(failed[0], failed[0] + handoff.SILENT_BEATS + 1))
        assert outcome.from_page == 4 and sorted(copied.pages) == [0, 1, 2, 3]
        _assert_bit_for_bit(copied, kv)
        c = consumer.counters
        assert (c.pd_receives, c.pd_receives_producer_silent, c.pd_receive_failures) == (1, 0, 0)


def test_with_a_tenant_key_hand_off_parameters_forged_or_altered_by_a_client_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode server takes ``kv_transfer_params`` from whoever reaches it. With a tenant key the
    check is a MAC that only holders of the key can make, over the tokens, the hand-off id and the
    pulse period: a check made without the key, or a real one sent with another id (no marker or
    pulse would ever be seen) or another period (none missed within the bound), is refused at
    once, counted, and vLLM computes the prompt; the parameters as the producer made them arrive."""
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    shared = [{"kind": "file", "path": str(tmp_path / "shared"), "name": "shared"}]
    key = "the-tenants-shared-key-0123456789"
    cfg = _config(shared, tenant_key=key)
    tokens = make_tokens(4 * PS)
    kv = make_kv(cfg, 4 * PS)
    with _pair(cfg, _config(shared, tenant_key=key), send_s=5.0, receive_s=5.0) as (portal, producer, consumer):
        portal.call(producer.cache.store, tokens, kv)
        handed = portal.call(producer.handoffs.handoff, "r1", tokens, "h-1")
        assert handed["tokens"] == 4 * PS and handed["pulse_s"] == handoff.PULSE_S
        _wait(lambda: producer.handoffs.take({"r1"})[0])

        def expect(req: str, check: str, handoff_id: Any, pulse_s: Any, promised: int = 4 * PS) -> bool:
            return portal.call(consumer.handoffs.expect, req, tokens[:promised], promised, [check], 0, handoff_id,
                               pulse_s)

        # The best a client without the key can make: the check of the same model's namespace, unkeyed.
        unkeyed = namespace_from_config(_config(shared)).digest
        assert not expect("f1", page_check(unkeyed, tokens, PS, "h-1", handoff.PULSE_S), "h-1", handoff.PULSE_S)
        assert not expect("f2", handed["check"], "h-2", handed["pulse_s"])  # another id
        assert not expect("f3", handed["check"], "h-1", 60.0)  # a period that never runs out in the bound
        assert not expect("f4", handed["check"], "h-1", None)  # the pulse dropped
        assert not expect("f5", handed["check"], "h-1", handed["pulse_s"], promised=2 * PS)  # other tokens
        assert consumer.counters.pd_receives_refused == 5
        assert consumer.handoffs.in_flight == (0, 0)  # nothing waits for any of them
        # The parameters as the producer made them: received whole, bit for bit.
        assert expect("r1", handed["check"], "h-1", handed["pulse_s"])
        copied = Copied()
        portal.call(consumer.begin_receives, [ReceiveSpec("r1", tokens, 0, 4, (list(range(4)),))], copied)
        (outcome,) = _received(consumer)
        assert outcome.from_page == 4 and sorted(copied.pages) == [0, 1, 2, 3]
        _assert_bit_for_bit(copied, kv)
