"""The producer's side of ``kind: nixl-peer``: pages in one registered buffer, and who is reading them.

``PageArena`` owns ``capacity`` bytes (one numpy buffer, registered with UCX once, so its metadata
never changes while peers read it) and places each page in free byte ranges of it: a page takes
exactly its size, in one range where one is free, else in several (up to ``MAX_SPANS``: a transfer
reads any number of ranges, so free space scattered in small holes still holds pages). It keeps the
pages least recently used first and evicts from them to make room.

**Leases.** A reader that located pages (``locate(..., lease=True)``) holds them under a lease
until it releases it or ``lease_s`` passes: a leased page is never evicted, and one overwritten or
deleted meanwhile leaves the index at once but keeps its bytes until the last lease on it ends, so
a remote read in flight never sees its ranges reused. (Past ``lease_s`` the ranges may be reused;
the reader's checksum then fails and the page is a miss.)

Leases never stop the arena from storing: a lease holds each page once however often its keys
repeat; an owner (a consumer's connection) holds at most ``leases_per_owner`` (past it, its oldest
is revoked) and only it may release them (they end when its connection does); and all leases
together hold at most ``lease_share`` of the arena's bytes (past it, the oldest are revoked, and a
lease that alone would exceed it covers the pages that fit). A revoked lease is one that ended
early: its reader's check fails on a reused range, a miss.

Thread-safe: the server's threads and the backend's worker threads share it under one lock; the
bytes of a page are copied in outside the lock, before it is published.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..base import PageIO, fits
from .agent import Region, address_of, pair, regions_of

__all__ = ["MAX_SPANS", "Located", "PageArena"]

Span = tuple[int, int]  # (offset in the arena, length)
#: Most ranges one page is placed in (a reader's descriptors, and what ``peer_wire`` accepts).
MAX_SPANS = 64


class _Extents:
    """Free byte ranges of the arena, by start; neighbours merge when freed."""

    def __init__(self, size: int) -> None:
        self._starts: list[int] = [0] if size else []
        self._length: dict[int, int] = {0: size} if size else {}
        self.free = size

    def take(self, n: int) -> list[Span] | None:
        """``n`` bytes: the first range that holds them all, else the largest ranges first; ``None``
        (nothing taken) if fewer than ``n`` bytes are free."""
        if n > self.free:
            return None
        for start in self._starts:
            if self._length[start] >= n:
                return [self._cut(start, n)]
        spans = []
        for start in sorted(self._starts, key=lambda s: -self._length[s]):
            spans.append(self._cut(start, min(n, self._length[start])))
            n -= spans[-1][1]
            if n == 0:
                break
        return spans

    def _cut(self, start: int, n: int) -> Span:
        length = self._length.pop(start)
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        if n < length:
            self._starts.insert(i, start + n)
            self._length[start + n] = length - n
        self.free -= n
        return start, n

    def give(self, spans: Sequence[Span]) -> None:
        for start, n in spans:
            if n <= 0:
                continue
            self.free += n
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and start + n == self._starts[i]:  # merge with the next range
                n += self._length.pop(self._starts[i])
                del self._starts[i]
            before = self._starts[i - 1] if i > 0 else None
            if before is not None and before + self._length[before] == start:  # and with the previous one
                self._length[before] += n
            else:
                self._starts.insert(i, start)
                self._length[start] = n

    def ranges(self) -> list[Span]:
        """The free ranges, by start (for tests)."""
        return [(s, self._length[s]) for s in self._starts]


@dataclass
class _Page:
    spans: list[Span]
    size: int
    readers: int = 0
    gone: bool = False  # out of the index (overwritten, deleted, evicted) but still leased


@dataclass(frozen=True)
class Located:
    """A page a reader may fetch: its size and where its bytes are (offsets in the arena, in order)."""

    size: int
    spans: tuple[Span, ...]


@dataclass
class _Lease:
    expires: float
    owner: int
    pages: list[_Page] = field(default_factory=list)  # each page once


class PageArena:
    def __init__(
        self, capacity: int, lease_s: float, *, lease_share: float = 0.5, leases_per_owner: int = 16
    ) -> None:
        self.buffer = np.zeros(capacity, dtype=np.uint8)  # untouched pages cost no memory until written
        self.base = address_of(memoryview(self.buffer))
        self.capacity = capacity
        self.lease_s = lease_s
        #: Most bytes all leases may hold at once (the rest can always be evicted for new pages).
        self.max_pinned = int(capacity * lease_share)
        self.leases_per_owner = leases_per_owner
        self._free = _Extents(capacity)
        self._pages: OrderedDict[bytes, _Page] = OrderedDict()  # least recently used first
        self._leases: dict[int, _Lease] = {}  # oldest first
        self._owned: dict[int, list[int]] = {}  # owner -> its lease ids, oldest first
        self._expiry: deque[tuple[float, int]] = deque()  # (expires, lease id), in order: lease_s is fixed
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.used = 0
        #: Bytes of the pages some lease holds (those gone from the index included).
        self.pinned = 0
        self.evicted = 0
        #: Leases ended early: over ``leases_per_owner`` or ``lease_share``.
        self.revoked = 0

    def __len__(self) -> int:
        return len(self._pages)

    # -- writing ----------------------------------------------------------------------------------

    def store(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        """Copy pages in; how many consecutive ones fit (never evicting this call's own pages)."""
        batch = set(keys)
        for i, (key, io) in enumerate(zip(keys, pages, strict=True)):
            with self._lock:
                self._expire()
                spans = self._room(io.nbytes, batch)
                if spans is None:
                    return i
            _copy([(self.base + s, n, 0) for s, n in spans], regions_of(io.buffers()))
            with self._lock:
                self._drop(key)
                self._pages[key] = _Page(spans, io.nbytes)
                self.used += io.nbytes
        return len(keys)

    def _room(self, n: int, keep: set[bytes]) -> list[Span] | None:
        """Free ranges for ``n`` bytes, in at most ``MAX_SPANS`` pieces, evicting the least recently
        used unleased pages (not of this call) until they fit; ``None`` if they cannot."""
        if n > self.capacity:
            return None
        while True:
            spans = self._free.take(n)
            if spans is not None and len(spans) <= MAX_SPANS:
                return spans
            if spans is not None:
                self._free.give(spans)  # too scattered: make a larger hole first
            victim = next((k for k, p in self._pages.items() if k not in keep and p.readers == 0), None)
            if victim is None:
                return None
            self._drop(victim)
            self.evicted += 1

    def _drop(self, key: bytes) -> None:
        page = self._pages.pop(key, None)
        if page is None:
            return
        self.used -= page.size
        if page.readers:
            page.gone = True  # its bytes are freed when the last lease on it ends
        else:
            self._free.give(page.spans)

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._drop(key)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._pages):
                self._drop(key)

    # -- reading ----------------------------------------------------------------------------------

    def count(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._pages:
                    return i
            return len(keys)

    def locate(self, keys: Sequence[bytes], *, lease: bool, owner: int = 0) -> tuple[int, list[Located]]:
        """The consecutive pages present from the first, and a lease id on them (0: no lease).

        Under a lease, the pages are those the lease could hold (see the module docstring): fewer
        than are present when all leases together would hold over ``lease_share`` of the arena.
        """
        with self._lock:
            self._expire()
            found: list[_Page] = []
            for key in keys:
                page = self._pages.get(key)
                if page is None:
                    break
                self._pages.move_to_end(key)  # a read is a use
                found.append(page)
            lease_id = 0
            if lease and found:
                found = self._room_for_lease(found, owner)
            if lease and found:
                lease_id = next(self._ids)
                expires = time.monotonic() + self.lease_s
                distinct = list({id(p): p for p in found}.values())  # a key asked twice is held once
                self._leases[lease_id] = _Lease(expires, owner, distinct)
                self._owned.setdefault(owner, []).append(lease_id)
                self._expiry.append((expires, lease_id))
                for page in distinct:
                    if page.readers == 0:
                        self.pinned += page.size
                    page.readers += 1
            return lease_id, [Located(p.size, tuple(p.spans)) for p in found]

    def _room_for_lease(self, found: list[_Page], owner: int) -> list[_Page]:
        """Revoke the owner's oldest lease when it holds its most (owner 0, this process's own
        reads, excepted), then the oldest leases while the new one would take the pinned bytes
        over ``max_pinned``; the pages of ``found`` that fit then, from the first."""
        total, seen = 0, set()
        for n, page in enumerate(found):  # what one lease may hold at most, revoking nothing for more
            if id(page) not in seen:
                seen.add(id(page))
                total += page.size
                if total > self.max_pinned:
                    found = found[:n]
                    break
        mine = self._owned.get(owner, [])
        while owner and len(mine) >= self.leases_per_owner:
            self._revoke(mine[0])
        while self._leases and self.pinned + self._unpinned_bytes(found) > self.max_pinned:
            self._revoke(next(iter(self._leases)))
        extra, seen = 0, set()
        for n, page in enumerate(found):
            if page.readers == 0 and id(page) not in seen:
                if self.pinned + extra + page.size > self.max_pinned:
                    return found[:n]
                extra += page.size
                seen.add(id(page))
        return found

    @staticmethod
    def _unpinned_bytes(pages: list[_Page]) -> int:
        return sum(p.size for p in {id(p): p for p in pages if p.readers == 0}.values())

    def _revoke(self, lease_id: int) -> None:
        self._end(lease_id)
        self.revoked += 1

    def release(self, lease_id: int, owner: int | None = None) -> None:
        """End a lease; with ``owner``, only one of that owner's (another's id is ignored)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and (owner is None or lease.owner == owner):
                self._end(lease_id)

    def end_owner(self, owner: int) -> None:
        """End every lease of ``owner`` (its connection closed)."""
        with self._lock:
            for lease_id in list(self._owned.get(owner, ())):
                self._end(lease_id)

    def leases_of(self, owner: int) -> int:
        with self._lock:
            return len(self._owned.get(owner, ()))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            self._end(self._expiry.popleft()[1])

    def _end(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        mine = self._owned[lease.owner]
        mine.remove(lease_id)
        if not mine:
            del self._owned[lease.owner]
        for page in lease.pages:
            page.readers -= 1
            if page.readers == 0:
                self.pinned -= page.size
                if page.gone:
                    self._free.give(page.spans)

    def read(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        """Copy pages out of the arena (a backend that serves and reads its own pages)."""
        lease_id, found = self.locate(keys, lease=True)
        try:
            for i, (page, io) in enumerate(zip(found, into, strict=False)):
                if not fits(page.size, io.nbytes, sizes):
                    return i
                _copy(regions_of(io.buffers(), page.size), [(self.base + s, n, 0) for s, n in page.spans])
                if sizes is not None:
                    sizes[i] = page.size
                if io.landed is not None:
                    io.landed()
            return len(found)
        finally:
            self.release(lease_id)

    def leases(self) -> int:
        with self._lock:
            return len(self._leases)


def _copy(dst: list[Region], src: list[Region]) -> None:
    """Copy ``src`` regions into ``dst`` regions (equal totals), piece by piece; ctypes releases the GIL."""
    rows_d, rows_s = pair(dst, src)
    for (d, n, _), (s, _, _) in zip(rows_d.tolist(), rows_s.tolist(), strict=True):
        ctypes.memmove(int(d), int(s), int(n))
