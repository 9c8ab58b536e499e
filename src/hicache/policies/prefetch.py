"""Prefetch policies: how long ``retrieve`` waits for pages still on their way up from storage.

A prefetch starts when ``lookup`` (or ``retrieve``) finds pages in storage beyond what memory holds,
at least ``prefetch_threshold_tokens`` of them. ``retrieve`` then waits as the policy says, takes
the pages that have arrived, and ends the prefetch:

* ``best_effort``: no wait; whatever arrived since ``lookup`` started it (SGLang's old default).
* ``wait_complete``: until every page has arrived (or the prefetch stopped early).
* ``timeout``: until complete, or ``min(max_s, base_s + per_ki_token_s * tokens / 1024)`` seconds
  after the prefetch started, whichever comes first.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

__all__ = ["PrefetchPolicy", "BestEffort", "WaitComplete", "Timeout"]


class PrefetchPolicy(ABC):
    name: str = "prefetch"

    @abstractmethod
    def wait_s(self, tokens: int) -> float:
        """Seconds after a prefetch of ``tokens`` started that a retrieve may wait for it."""


class BestEffort(PrefetchPolicy):
    name = "best_effort"

    def wait_s(self, tokens: int) -> float:
        return 0.0


class WaitComplete(PrefetchPolicy):
    name = "wait_complete"

    def wait_s(self, tokens: int) -> float:
        return math.inf


class Timeout(PrefetchPolicy):
    name = "timeout"

    def __init__(self, base_s: float = 2.0, per_ki_token_s: float = 0.1, max_s: float = 30.0) -> None:
        self.base_s = base_s
        self.per_ki_token_s = per_ki_token_s
        self.max_s = max_s

    def wait_s(self, tokens: int) -> float:
        return min(self.max_s, self.base_s + self.per_ki_token_s * tokens / 1024)
