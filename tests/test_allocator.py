"""The page allocator: exact accounting and few runs."""

from __future__ import annotations

import pytest

from hicache import CapacityError
from hicache.tiers import PageAllocator


def runs(pages: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1) if pages else 0


def test_all_or_nothing_and_exact_counts() -> None:
    alloc = PageAllocator(8)
    a = alloc.allocate(5)
    assert len(set(a)) == 5 and alloc.num_free == 3
    with pytest.raises(CapacityError):
        alloc.allocate(4)
    assert alloc.num_free == 3  # a failed allocation changes nothing
    alloc.free(a)
    assert alloc.num_free == 8 and alloc.allocate(0) == []


def test_double_free_is_caught() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(pages[:1])
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([3, 3])


def test_prefers_one_run_best_fit_then_longest_runs() -> None:
    alloc = PageAllocator(20)
    alloc.allocate(20)
    alloc.free([0, 1, 2])  # run of 3
    alloc.free(list(range(5, 10)))  # run of 5
    alloc.free([12, 13])  # run of 2
    assert alloc.allocate(4) == [5, 6, 7, 8]  # smallest run that fits
    assert runs(alloc.allocate(4)) == 2  # no run of 4 left: [0, 1, 2] + one more
    assert alloc.num_free == 2
