"""The allocator's free-run index against a brute-force model, under random programs.

The model keeps the free pages as a plain set and recomputes the runs from scratch each time:
best fit (the smallest run that holds the request, lowest start among equals), else the longest
runs first (lowest start among equals), exactly as the allocator's docstring promises. The real
allocator must hand out the very same pages, keep maximal runs, and count exactly.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache import CapacityError
from hicache.tiers import PageAllocator


def model_runs(free: set[int]) -> list[tuple[int, int]]:
    """Maximal runs of ``free`` as ``(start, length)``, by start."""
    runs: list[tuple[int, int]] = []
    for page in sorted(free):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def model_pick(free: set[int], n: int) -> list[int]:
    runs = model_runs(free)
    fitting = [(length, start) for start, length in runs if length >= n]
    if fitting:
        _, start = min(fitting)
        return list(range(start, start + n))
    picked: list[int] = []
    for start, length in sorted(runs, key=lambda r: (-r[1], r[0])):
        take = min(n - len(picked), length)
        picked += range(start, start + take)
        if len(picked) == n:
            break
    return sorted(picked)


# A program: (pool size, steps); a step allocates n pages, or frees a random subset of what is held.
steps_st = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 24)),
        st.tuples(st.just("free"), st.lists(st.integers(0, 10_000), max_size=12)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 64), steps=steps_st)
def test_allocator_matches_the_brute_force_model(size: int, steps: list[tuple[str, object]]) -> None:
    alloc = PageAllocator(size)
    free = set(range(size))
    held: list[int] = []
    for op, arg in steps:
        if op == "alloc":
            n = arg
            assert isinstance(n, int)
            if n > len(free):
                with pytest.raises(CapacityError):
                    alloc.allocate(n)
                continue
            expected = model_pick(free, n) if n else []
            got = alloc.allocate(n)
            assert got == expected
            free -= set(got)
            held += got
        else:
            assert isinstance(arg, list)
            chosen = sorted({held[i % len(held)] for i in arg}) if held else []
            alloc.free(chosen)
            free |= set(chosen)
            held = [p for p in held if p not in set(chosen)]
        assert alloc.num_free == len(free) and alloc.num_used == size - len(free)
        assert alloc.free_runs() == model_runs(free)
        assert all(alloc.is_allocated(p) == (p not in free) for p in range(size))


def test_best_fit_keeps_the_large_run_and_frees_merge() -> None:
    alloc = PageAllocator(100)
    pages = alloc.allocate(100)
    alloc.free(pages[10:20])  # a 10-page hole
    alloc.free(pages[50:100])  # a 50-page tail
    assert alloc.allocate(8) == list(range(10, 18))  # the hole, not the tail
    assert alloc.free_runs() == [(18, 2), (50, 50)]
    alloc.free(list(range(20, 50)))  # bridges the hole's rest and the tail: one run
    assert alloc.free_runs() == [(18, 82)]


def test_fragmented_allocation_takes_the_longest_runs_first() -> None:
    alloc = PageAllocator(30)
    alloc.allocate(30)
    alloc.free([0, 1, 5, 6, 7, 10, 11, 12, 20])  # runs of 2, 3, 3, 1
    assert alloc.allocate(7) == [0, 5, 6, 7, 10, 11, 12]  # 3 + 3 (lowest start first) + 1 of the 2-run
    assert alloc.free_runs() == [(1, 1), (20, 1)]


def test_foreign_and_repeated_pages_raise_and_change_nothing() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(4)
    for bad in ([8], [-1], [pages[0], pages[0]], [5]):
        with pytest.raises(AssertionError):
            alloc.free(bad)
        assert alloc.num_free == 4 and alloc.free_runs() == [(4, 4)]


def test_a_fragmented_million_page_pool_stays_exact() -> None:
    """500,000 one-page runs: one distinct length to search, picks and merges still exact."""
    alloc = PageAllocator(1_000_000)
    pages = alloc.allocate(1_000_000)
    alloc.free(pages[::2])  # the even pages: 500,000 runs of one page
    assert len(alloc._runs._lengths) == 1 and len(alloc.free_runs()) == 500_000
    assert alloc.allocate(3) == [0, 2, 4]  # no run fits: equal lengths, lowest starts first
    alloc.free([0, 1, 2, 3, 4, 5])  # merges with free page 6 into [0, 7)
    assert alloc.free_runs()[:2] == [(0, 7), (8, 1)]
    assert alloc.num_free == 500_000 + 3
