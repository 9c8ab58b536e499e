"""What goes into the reference engine (``Request``) and what comes out (``RequestResult``)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["Request", "RequestResult"]

_ids = itertools.count()


@dataclass(frozen=True)
class Request:
    """A chat request: prompt token ids in, up to ``max_new_tokens`` greedy tokens out.

    Generation stops early at a token in ``stop_tokens`` (empty: always ``max_new_tokens``, as
    benchmarks want). ``tags`` ride along untouched (a benchmark's client and round).
    """

    tokens: tuple[int, ...]
    max_new_tokens: int
    stop_tokens: frozenset[int] = frozenset()
    tags: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class RequestResult:
    """One finished request and its timeline (seconds on the engine's monotonic clock).

    ``token_times[i]`` is when output token ``i`` was ready; ``by_tier`` says where the
    ``cached_tokens`` of the prompt came from (``device``, ``host``, storage tier names).
    ``stages`` are the seconds the request spent in each stage (``lookup`` and the sequence's
    ``Sequence.STAGES``); ``restore_wait_by_layer`` the seconds its prefill waited for each
    layer's load-back.
    """

    request: Request
    output: tuple[int, ...]
    arrival_s: float
    admitted_s: float
    token_times: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int
    by_tier: Mapping[str, int]
    stages: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    restore_wait_by_layer: tuple[float, ...] = ()
    ttft_cpu_s: float | None = None  # CPU seconds of the process from arrival to first token (with a cpu_clock)

    @property
    def ttft_s(self) -> float:
        """Time to first token, from arrival (queueing included, as a user sees it)."""
        return self.token_times[0] - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.admitted_s - self.arrival_s

    @property
    def prefill_s(self) -> float:
        """From admission to the first token: restore plus compute of the uncached part."""
        return self.token_times[0] - self.admitted_s

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        t = self.token_times
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def finished_s(self) -> float:
        return self.token_times[-1]
