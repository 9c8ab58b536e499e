"""Drives conversations through an engine: arrivals, a ready queue, a concurrency cap.

Like SGLang's ``bench_multiturn.py``: conversations whose next turn can be sent wait in a ready
queue; the dispatcher sends one after each inter-arrival gap (Poisson at ``request_rate``, none
when infinite) once fewer than ``max_parallel`` requests are in flight, taking the oldest
(``fifo``) or a random one (``random``). When a reply arrives, the conversation's next turn is
ready (with ``round_barrier``, only once every conversation has finished that round).

Each request also gets two *ideal* cached lengths:

* ``ideal_tokens``: the longest prefix it shares with a prompt or answer seen before it was sent
  (the tokens an unlimited cache has *seen*). It counts the last answer token of an earlier turn,
  whose KV no engine computes (it is the last output, never fed back), and partial pages.
* ``computed_ideal_tokens``: the longest prefix whose KV was computed before (earlier prompts,
  and earlier answers but their last token), in whole pages of ``page_size``, and at most
  ``len(prompt) - 1`` (one token is always computed, to have logits): what a page-granular cache
  of unlimited capacity can serve, so ``cached / computed ideal`` reaches 1.0.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import anyio
import numpy as np

from ..engine import Engine, Request, RequestResult
from .workloads import Conversation

__all__ = ["DriverSettings", "Record", "drive"]


@dataclass(frozen=True)
class DriverSettings:
    request_rate: float = math.inf  # requests per second (Poisson); inf sends as soon as a slot is free
    max_parallel: int = 4
    ready_queue: Literal["fifo", "random"] = "fifo"
    round_barrier: bool = False
    seed: int = 0
    page_size: int = 1  # the cache's page size, for the page-aligned computed ideal


@dataclass(frozen=True)
class Record:
    """One request as the benchmark reports it (times in seconds)."""

    conversation: int
    round: int
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int
    by_tier: dict[str, int]
    ttft_s: float
    queue_s: float
    prefill_s: float
    itl_s: list[float]
    arrival_s: float
    finished_s: float
    output: list[int]
    # Optional, so engines measured elsewhere (``vllm_worker``) fill only what they know:
    computed_ideal_tokens: int | None = None
    ttft_cpu_s: float | None = None  # CPU seconds of the process from arrival to first token
    stages: dict[str, float] = field(default_factory=dict)
    restore_wait_by_layer: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, result: RequestResult, ideal: int, computed_ideal: int) -> Record:
        tags = result.request.tags
        return cls(
            conversation=tags["conversation"],
            round=tags["round"],
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            ideal_tokens=ideal,
            computed_ideal_tokens=computed_ideal,
            by_tier=dict(result.by_tier),
            ttft_s=result.ttft_s,
            ttft_cpu_s=result.ttft_cpu_s,
            queue_s=result.queue_s,
            prefill_s=result.prefill_s,
            itl_s=list(result.itl_s),
            arrival_s=result.arrival_s,
            finished_s=result.finished_s,
            output=list(result.output),
            stages=dict(result.stages),
            restore_wait_by_layer=list(result.restore_wait_by_layer),
        )


class _Seen:
    """Token sequences seen so far, to measure how much of a prompt was seen before."""

    def __init__(self) -> None:
        self._seqs: list[np.ndarray] = []

    def longest_prefix(self, tokens: list[int]) -> int:
        a = np.asarray(tokens, dtype=np.int64)
        best = 0
        for b in self._seqs:
            m = min(len(a), len(b))
            if m <= best:
                continue
            diff = np.flatnonzero(a[:m] != b[:m])
            best = max(best, int(diff[0]) if diff.size else m)
        return best

    def add(self, tokens: list[int]) -> None:
        self._seqs.append(np.asarray(tokens, dtype=np.int64))


async def drive(
    engine: Engine,
    conversations: list[Conversation],
    settings: DriverSettings,
    on_done: Callable[[Record], Any] | None = None,
) -> list[Record]:
    """Run every turn of ``conversations`` through ``engine``; one ``Record`` per request."""
    rng = random.Random(settings.seed)
    ready: list[Conversation] = [c for c in conversations if not c.done]
    waiting_round: list[Conversation] = []  # finished this round; released by the barrier
    in_round = Counter(r for c in conversations for r in c.rounds)  # requests left per round
    slots = anyio.Semaphore(settings.max_parallel)
    changed = anyio.Event()
    seen = _Seen()  # prompts and answers sent or received
    computed = _Seen()  # tokens whose KV was computed: prompts, and answers but their last token
    records: list[Record] = []
    remaining = sum(len(c.chunks) for c in conversations)

    async def send(conv: Conversation, prompt: list[int], ideal: int, computed_ideal: int) -> None:
        nonlocal changed, remaining
        round_ = conv.rounds[conv.turn]
        try:
            tags = MappingProxyType({"conversation": conv.id, "round": round_})
            result = await engine.generate(Request(prompt, conv.output_len, tags=tags))
        finally:
            slots.release()
        output = list(result.output)
        seen.add(prompt + output)
        computed.add(prompt + output[:-1])
        record = Record.of(result, ideal, computed_ideal)
        records.append(record)
        if on_done is not None:
            on_done(record)
        conv.advance(prompt, output)
        remaining -= 1
        in_round[round_] -= 1
        if not conv.done:
            (waiting_round if settings.round_barrier else ready).append(conv)
        if settings.round_barrier and in_round[round_] == 0:
            ready.extend(waiting_round)
            waiting_round.clear()
        changed.set()
        changed = anyio.Event()

    async with anyio.create_task_group() as tg:
        sent = 0
        total = remaining
        while sent < total:
            while not ready:
                await changed.wait()
            if math.isfinite(settings.request_rate):
                await anyio.sleep(rng.expovariate(settings.request_rate))
            await slots.acquire()
            conv = ready.pop(rng.randrange(len(ready)) if settings.ready_queue == "random" else 0)
            prompt = conv.next_prompt()
            ideal = seen.longest_prefix(prompt)
            ps = settings.page_size
            computed_ideal = min(computed.longest_prefix(prompt) // ps * ps, len(prompt) - 1)
            seen.add(prompt)
            computed.add(prompt)
            sent += 1
            tg.start_soon(send, conv, prompt, ideal, computed_ideal)
    return records
