"""Checking a batch of pages read in place while the backend is still reading it.

A fetch reads pages straight into host memory and must check every one (header fields, then the
checksum or MAC over header and payload) before any is used. Checking is one more pass over every
byte; done after the batch it is time the reader waits for. ``BatchChecks`` starts the checks as
the pages land instead: the backend calls each page's ``PageIO.landed`` hook from its own thread
(the file tier after each page's ``preadv``, ``kind: nixl-peer`` after each part of its UCX READ),
and once a group of pages adds up to ``GROUP_BYTES`` it becomes one task on the tier's codec
threads. Pages the backend did not report are checked after ``get`` returns (``finish``), so a
backend that never calls the hook loses the overlap and nothing else.

Grouping keeps the hand-over per task, not per page: a 3 MiB page is a task of its own, 200 small
pages share one. The result is what checking the pages in order would give: the number of good
pages from the start and why the next one is not good. Every page is checked; none is skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Any

__all__ = ["GROUP_BYTES", "BatchChecks"]

#: Bytes of pages one check task covers (at least one page): large enough that handing the task to
#: a thread (tens of microseconds) is small against hashing it (~0.12 ms per MiB with the GMAC).
GROUP_BYTES = 2 * 2**20

Check = Callable[[int], "str | None"]
Submit = Callable[..., "Future[Any]"]


class BatchChecks:
    """The checks of one batch of ``n`` pages of ``page_bytes``; ``check(i)`` is ``None`` or why not.

    ``submit`` runs a task on the tier's codec threads (``ThreadPoolExecutor.submit``); without it
    every check runs in ``result``. ``landed(i)`` may be called from any thread, in any order.
    """

    def __init__(self, check: Check, n: int, page_bytes: int, submit: Submit | None) -> None:
        self._check = check
        self._n = n
        self._submit = submit
        self._group = max(1, GROUP_BYTES // max(1, page_bytes))
        self._lock = threading.Lock()
        self._arrived = [False] * n if submit is not None else []
        self._ready = 0  # pages landed, consecutive from the first
        self._next = 0  # first page not yet in a task
        self._tasks: list[Future[tuple[int, str] | None]] = []

    def hook(self, i: int) -> Callable[[], None] | None:
        """Page ``i``'s ``PageIO.landed`` hook (``None`` when the checks run after the read anyway)."""
        if self._submit is None:
            return None
        return lambda: self.landed(i)

    def landed(self, i: int) -> None:
        """Page ``i`` is whole in its buffers: check it (with its group) once the group is complete."""
        with self._lock:
            if i >= self._n or self._arrived[i]:
                return
            self._arrived[i] = True
            while self._ready < self._n and self._arrived[self._ready]:
                self._ready += 1
            while self._ready - self._next >= self._group:
                self._start(self._next, self._next + self._group)

    def finish(self, n: int) -> None:
        """The backend read ``n`` pages: start the checks of those not started yet (cheap; any thread)."""
        if self._submit is None:
            return
        with self._lock:
            while self._next < n:
                self._start(self._next, min(n, self._next + self._group))

    @property
    def pooled(self) -> bool:
        """Whether checks run on the codec threads (else ``result`` runs them all)."""
        return self._submit is not None

    def settled(self) -> bool:
        """True when no check started is still running (then a pooled ``result`` does not wait)."""
        return all(task.done() for task in self._tasks)

    def result(self, n: int) -> tuple[int, str | None]:
        """``(good pages from the first, why page `good` is not good)`` over the first ``n`` pages.

        Waits for every check started (after ``finish(n)``); with no codec threads, runs them here.
        """
        if self._submit is None:
            found = self._run(0, n)
        else:
            self.finish(n)
            found = None
            for task in self._tasks:  # in page order; every one waited for
                got = task.result()
                if got is not None and got[0] < n and (found is None or got[0] < found[0]):
                    found = got
        return (n, None) if found is None else found

    def drain(self) -> None:
        """Wait for every check started (a cancelled fetch must not return while one reads its pages)."""
        wait_all(self._tasks)

    def _start(self, a: int, b: int) -> None:
        assert self._submit is not None
        self._tasks.append(self._submit(self._run, a, b))
        self._next = b

    def _run(self, a: int, b: int) -> tuple[int, str] | None:
        for i in range(a, b):
            reason = self._check(i)
            if reason is not None:
                return i, reason
        return None
