"""``BatchChecks``: the checks of a batch read in place, started as pages land, give what checking
every page in order gives: the good pages from the first, and why the next one is not good."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from hicache.tiers.storage.page_checks import GROUP_BYTES, BatchChecks


@pytest.fixture
def pool() -> ThreadPoolExecutor:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def checker(bad: set[int]) -> tuple[list[int], object]:
    calls: list[int] = []
    lock = threading.Lock()

    def check(i: int) -> str | None:
        with lock:
            calls.append(i)
        return "mac" if i in bad else None

    return calls, check


@pytest.mark.parametrize("page_bytes", [GROUP_BYTES * 2, GROUP_BYTES // 8, 1])
@pytest.mark.parametrize("threads", [0, 2])
def test_every_page_is_checked_once_whatever_lands(page_bytes: int, threads: int, pool: ThreadPoolExecutor) -> None:
    calls, check = checker(set())
    checks = BatchChecks(check, 40, page_bytes, pool.submit if threads else None)
    for i in [3, 0, 1, 2, 9, 5, 4, 39, 6, 5, 0]:  # out of order, repeated, with gaps
        hook = checks.hook(i)
        if hook is not None:
            hook()
    assert checks.result(40) == (40, None)
    assert sorted(calls) == list(range(40))  # none skipped, none twice


@pytest.mark.parametrize("page_bytes", [GROUP_BYTES * 2, GROUP_BYTES // 8])
def test_the_first_bad_page_ends_the_count(page_bytes: int, pool: ThreadPoolExecutor) -> None:
    _, check = checker({13, 27})
    checks = BatchChecks(check, 40, page_bytes, pool.submit)
    for i in range(40):
        checks.landed(i)
    assert checks.result(40) == (13, "mac")
    checks.drain()
    assert checks.settled()


def test_pages_past_what_the_backend_returned_do_not_count(pool: ThreadPoolExecutor) -> None:
    _, check = checker({30})
    checks = BatchChecks(check, 40, GROUP_BYTES, pool.submit)
    for i in range(35):
        checks.landed(i)  # landed, but the backend then returned 20 (a later page fell short)
    assert checks.result(20) == (20, None)
    _, check = checker({5})
    checks = BatchChecks(check, 40, GROUP_BYTES, None)
    assert checks.result(3) == (3, None) and checks.result(6) == (5, "mac")


def test_checks_start_before_the_batch_is_read(pool: ThreadPoolExecutor) -> None:
    """A complete group is checked on the pool while later pages have not landed yet."""
    started = threading.Event()

    def check(i: int) -> str | None:
        started.set()
        return None

    checks = BatchChecks(check, 10, GROUP_BYTES, pool.submit)  # one page a group
    checks.landed(0)
    assert started.wait(5)
    for i in range(1, 10):
        checks.landed(i)
    assert checks.result(10) == (10, None)
