"""``hicache bench pd``'s sizing and hand-off accounting, without servers."""

from __future__ import annotations

import argparse

from hicache.bench.pd_bench import _sizes, transfer_cost
from hicache.bench.workloads import LongContext, MultiTurn

TOKEN_BYTES = 45 * 1024


def _args(**kw: object) -> argparse.Namespace:
    base = {"block_size": 128, "max_parallel": 4, "max_running": None, "kv_fraction": 0.25, "host_fraction": 0.5}
    return argparse.Namespace(**(base | kw))


def test_a_prefill_host_holds_two_running_batches() -> None:
    """The prompts being saved and the hand-offs still being made durable are both pinned: the
    host tier has room for both, so no store finds every page pinned and drops pages."""
    workloads = {
        "multiturn": MultiTurn(clients=4, rounds=3, request_len=512, output_len=16),
        "long-context": LongContext(documents=4, document_len=1536, questions=3, question_len=64, output_len=16),
    }
    sizes = _sizes(_args(), workloads, TOKEN_BYTES)
    pages = sizes["host_tokens"] // 128
    assert pages >= 2 * sizes["running"] * sizes["max_model_len"] // 128 + 1
    assert sizes["host_bytes"] == pages * 128 * TOKEN_BYTES
    # A larger host fraction still wins over the floor.
    big = _sizes(_args(host_fraction=8.0), workloads, TOKEN_BYTES)
    assert big["host_tokens"] > sizes["host_tokens"]


def _snapshot(dropped: int, received: int, given_up: int = 0, silent: int = 0) -> dict[str, object]:
    return {
        "prefill": {"connector": {"pd_sends": 1}, "cache": {"dropped_pages": dropped, "storage": {}}},
        "decode": {"connector": {"pd_receives": received, "pd_receives_given_up": given_up,
                                 "pd_receives_producer_silent": silent}, "cache": {"storage": {}}},
    }


def test_transfer_cost_reports_the_pages_the_producer_dropped() -> None:
    raw = {"write_gbps": 1.0, "read_gbps": 1.0}
    cost = transfer_cost(_snapshot(3, 0), _snapshot(11, 2), raw, TOKEN_BYTES)
    assert cost["producer_dropped_pages"] == 8
    assert cost["handoffs"] == 2


def test_transfer_cost_reports_receives_ended_by_a_marker_or_by_silence() -> None:
    """A receive its producer's silence ended while the producer lived would be a false alarm: the
    bench shows both kinds of early end beside each other."""
    raw = {"write_gbps": 1.0, "read_gbps": 1.0}
    cost = transfer_cost(_snapshot(0, 0, 1, 2), _snapshot(0, 4, 2, 5), raw, TOKEN_BYTES)
    assert (cost["ended_by_marker"], cost["ended_by_silence"]) == (1, 3)
