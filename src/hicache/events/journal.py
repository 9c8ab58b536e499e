"""The event journal: what each tier can serve, as KV events (``base.py``), from residency changes.

**What is announced.** A page is ``BlockStored`` for a medium when it holds a copy there *and is
reachable*: every page before it holds a copy somewhere here too, since a hit is a prefix (a page in
storage after a page no tier holds any more cannot be served). It is ``BlockRemoved`` when the copy
goes, or when it stops being reachable (its copies stay, unannounced, and are announced again when
the gap is filled). So a router's union over media, walked from the first block, is what this
instance serves, also beside an engine's own device blocks (vLLM serves its own prefix or hicache's,
whichever is longer).

**Where it listens**, and nowhere else:

* the tree's ``residency_hook``: a node gained or lost its device or host copy (splits move pages
  without telling: nothing changes for a router);
* each storage tier's ``stored_hook`` (pages written and sealed: a read verifies them) and its
  backend's ``removed_hook`` (deleted, evicted, failed verification, cleared; a tier that starts
  failing reports all its pages gone); ``unwatch`` when a tier is detached. A shared tier detached or
  failing here is forgotten without removals: its pages are still there for the other instances.

It keeps, per known page, its parent's hash and token ids (a storage write carries only keys), so a
page is announced with the same chain in every medium; a page written to storage that it never knew
is not announced (``unannounced``). Storage keys are the codec's names (``storage_keys``): it keeps
each tier's storage key -> page key for what it announced there.

**Drops.** The sink never waits; when it drops events a router's index may have missed some, so the
journal announces ``AllBlocksCleared`` and every announced copy as soon as the sink has room for all
of it (``resyncs``). Inside an engine that publishes its own blocks on the same stream
(``clean_slate=False``), ``AllBlocksCleared`` would clear those too: there it sends none, a close
removes what it announced, and a resync re-announces what holds (a lost removal stays lost).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import CPU, DISK, GPU, SHARED, AllBlocksCleared, BlockRemoved, BlockStored
from .base import EventSink, KVEvent

__all__ = ["EventJournal", "Medium", "block_hash"]

_PERSON = b"hicache-kv-event"  # the digest's domain: a block hash is not a page key nor a storage name


def block_hash(page_key: bytes) -> int:
    """The 64-bit hash a router sees for a page: one-way from the page key (keyed namespaces' keys
    stay secret), unsigned, as vLLM's integer block hashes are."""
    return int.from_bytes(hashlib.blake2b(page_key, digest_size=8, person=_PERSON).digest(), "big")


@dataclass(frozen=True, slots=True)
class Medium:
    """Where a copy is, in the events' terms."""

    medium: str
    locality: str | None = None
    ownership: str | None = None


DEVICE_MEDIUM = Medium(GPU)
HOST_MEDIUM = Medium(CPU)
_ORDER = {GPU: 0, CPU: 1, DISK: 2, SHARED: 3}


def _order(medium: Medium) -> int:
    return _ORDER.get(medium.medium, 4)


def storage_medium(shared: bool) -> Medium:
    return Medium(SHARED) if shared else Medium(DISK)


class _Page:
    """A page the journal knows: its copies, its chain, and whether it is announced.

    A page is *reachable* when it holds a copy and so does every page before it: only then can this
    instance serve it (a hit is a prefix), and only then are its copies announced. A page whose
    copies are all gone stays as a ghost while pages after it are known, so they find it again."""

    __slots__ = ("held", "parent", "parent_key", "tokens", "children", "announced")

    def __init__(self, parent_key: bytes | None, tokens: list[int]) -> None:
        self.held: set[Medium] = set()
        self.parent_key = parent_key
        self.parent = block_hash(parent_key) if parent_key is not None else None
        self.tokens = tokens
        self.children: set[bytes] = set()
        self.announced = False


class EventJournal:
    """Turns residency changes into events for ``sink``. Thread-safe (storage backends may report
    from their threads); never blocks on the sink."""

    def __init__(self, sink: EventSink, *, page_size: int, shared: Callable[[str, str], bool],
                 device: bool = True, clean_slate: bool = True) -> None:
        self.sink = sink
        #: Whether ``AllBlocksCleared`` is this journal's to send. Not inside an engine that publishes
        #: its own blocks on the same stream (vLLM): it would clear those too in every router. Then
        #: a start sends nothing, a close removes what was announced, and a resync re-announces.
        self.clean_slate = clean_slate
        self.device = device  # announce the device tier (not where the engine announces its own)
        self.page_size = page_size
        self._shared = shared  # (tier name, backend kind) -> whether instances share the tier
        self._pages: dict[bytes, _Page] = {}  # page key -> its copies and chain
        self._orphans: dict[bytes, set[bytes]] = {}  # a parent not known (yet) -> its known children
        self._storage: dict[str, dict[bytes, bytes]] = {}  # tier name -> storage key -> page key
        self._media: dict[str, Medium] = {}
        self._lock = threading.Lock()
        self.unannounced = 0  # pages written to storage that this journal never knew
        self.stored_events = self.removed_events = 0
        self.resyncs = 0  # clean slates announced after the sink dropped events
        self._lost = False  # the sink dropped events since the last clean slate

    # -- lifecycle ------------------------------------------------------------------------------

    def open(self) -> None:
        """Start the sink and announce a clean slate (what a previous process announced is gone)."""
        self.sink.start()
        self.clear_all()

    def close(self) -> None:
        """Announce that this instance serves nothing any more, then stop the sink (after sending)."""
        self.clear_all()
        self.sink.close()

    def clear_all(self) -> None:
        """Announce that nothing announced before holds (a start, a restart, a close): one
        ``AllBlocksCleared``, or without ``clean_slate`` the removal of each announced copy."""
        with self._lock:
            gone = [(block_hash(key), m) for key, page in self._pages.items() if page.announced for m in page.held]
            self._pages.clear()
            self._orphans.clear()
            for keys in self._storage.values():
                keys.clear()
            if self.clean_slate:
                self._lost = not self.sink.put([AllBlocksCleared()])
            else:
                self._emit_removed(gone)

    # -- the tree -------------------------------------------------------------------------------

    def residency(self, node, tier: str, held: bool) -> None:  # noqa: ANN001 - a TreeNode
        """The tree's ``residency_hook``."""
        if tier == "device" and not self.device:
            return
        medium = DEVICE_MEDIUM if tier == "device" else HOST_MEDIUM
        keys = node.keys
        with self._lock:
            if held:
                parent = node.parent
                prev = parent.key(-1) if parent is not None and parent.num_pages else None
                tokens = np.frombuffer(node.tokens, dtype=np.int64)
                ps = self.page_size
                for i, key in enumerate(keys):
                    if key not in self._pages:
                        self._know(key, _Page(prev, tokens[i * ps : (i + 1) * ps].tolist()))
                    prev = key
                self._add(keys, medium)
            else:
                self._drop(keys, medium)

    # -- storage tiers --------------------------------------------------------------------------

    def watch(self, tier) -> None:  # noqa: ANN001 - a StorageTier
        """Follow a storage tier: its writes (``tier.stored_hook``) and its backend's removals."""
        name = tier.name
        with self._lock:
            self._media[name] = storage_medium(self._shared(name, tier.backend.kind))
            self._storage.setdefault(name, {})
        tier.stored_hook = self.stored
        tier.backend.removed_hook = lambda keys: self.removed(name, keys)

    def unwatch(self, tier) -> None:  # noqa: ANN001 - a StorageTier
        """A tier detached or lost: every page announced there is removed."""
        self.removed(tier.name, None)
        tier.stored_hook = None
        tier.backend.removed_hook = None

    def stored(self, tier_name: str, page_keys: Sequence[bytes], storage_keys: Sequence[bytes]) -> None:
        """Pages written to a tier (sealed: a read verifies them)."""
        with self._lock:
            medium = self._media.get(tier_name)
            if medium is None:
                return
            names = self._storage[tier_name]
            keys = []
            for key, skey in zip(page_keys, storage_keys, strict=True):
                if key not in self._pages:
                    self.unannounced += 1
                    continue
                names[skey] = key
                keys.append(key)
            self._add(keys, medium)

    def removed(self, tier_name: str, storage_keys: Sequence[bytes] | None) -> None:
        """Storage keys a tier no longer holds (None: all it was announced with)."""
        with self._lock:
            medium = self._media.get(tier_name)
            names = self._storage.get(tier_name)
            if medium is None or names is None:
                return
            if storage_keys is None:
                keys = list(names.values())
                names.clear()
                if medium.medium == SHARED:  # still there for the other instances: no removals
                    self._drop(keys, medium, announce=False)
                    return
            else:
                keys = [k for k in (names.pop(s, None) for s in storage_keys) if k is not None]
            self._drop(keys, medium)

    def _know(self, key: bytes, page: _Page) -> None:
        """A new page, linked both ways: to its parent (or among the orphans until the parent is
        known: the device tier is not followed inside vLLM) and to the pages after it."""
        self._pages[key] = page
        page.children = self._orphans.pop(key, set())
        parent_key = page.parent_key
        if parent_key is not None:
            parent = self._pages.get(parent_key)
            if parent is not None:
                parent.children.add(key)
            else:
                self._orphans.setdefault(parent_key, set()).add(key)

    # -- events ---------------------------------------------------------------------------------

    def _reachable_parent(self, page: _Page) -> bool:
        if page.parent_key is None:
            return True
        parent = self._pages.get(page.parent_key)
        return parent is not None and parent.announced

    def _add(self, keys: Sequence[bytes], medium: Medium) -> None:
        """Copies in ``medium``: announced for reachable pages; a page that becomes reachable
        announces all its copies, and so do the pages after it that it makes reachable."""
        out: list[tuple[bytes, _Page, Medium]] = []
        for key in keys:
            page = self._pages[key]
            if medium in page.held:
                continue
            page.held.add(medium)
            if page.announced:
                out.append((key, page, medium))
            elif self._reachable_parent(page):
                self._announce(key, page, out)
        self._emit_stored(out)

    def _announce(self, key: bytes, page: _Page, out: list[tuple[bytes, _Page, Medium]]) -> None:
        stack = [(key, page)]
        while stack:
            key, page = stack.pop()
            page.announced = True
            out.extend((key, page, m) for m in sorted(page.held, key=_order))
            for child_key in page.children:
                child = self._pages.get(child_key)
                if child is not None and child.held and not child.announced:
                    stack.append((child_key, child))

    def _drop(self, keys: Sequence[bytes], medium: Medium, *, announce: bool = True) -> None:
        """``keys`` lost their copy in ``medium``; a page left with none makes the pages after it
        unreachable: their copies are announced removed (not with ``announce=False``)."""
        gone: list[tuple[int, Medium]] = []
        for key in keys:
            page = self._pages.get(key)
            if page is None or medium not in page.held:
                continue
            page.held.discard(medium)
            if page.announced:
                gone.append((block_hash(key), medium))
                if not page.held:
                    self._hide(key, page, gone)
            self._prune(key, page)
        if announce:
            self._emit_removed(gone)

    def _hide(self, key: bytes, page: _Page, gone: list[tuple[int, Medium]]) -> None:
        page.announced = False
        stack = list(page.children)
        while stack:
            child_key = stack.pop()
            child = self._pages.get(child_key)
            if child is None or not child.announced:
                continue
            child.announced = False
            gone.extend((block_hash(child_key), m) for m in child.held)
            stack.extend(child.children)

    def _prune(self, key: bytes, page: _Page) -> None:
        """Forget a page with no copy and nothing after it, and ghosts it leaves behind."""
        while not page.held and not page.children:
            del self._pages[key]
            parent_key = page.parent_key
            if parent_key is None:
                return
            parent = self._pages.get(parent_key)
            if parent is None:
                orphans = self._orphans.get(parent_key)
                if orphans is not None:
                    orphans.discard(key)
                    if not orphans:
                        del self._orphans[parent_key]
                return
            parent.children.discard(key)
            key, page = parent_key, parent

    def _emit_stored(self, out: list[tuple[bytes, _Page, Medium]]) -> None:
        """Announce copies, medium by medium, as runs of a chain."""
        events: list[KVEvent] = []
        by_medium: dict[Medium, list[tuple[int, _Page]]] = {}
        for key, page, medium in out:
            by_medium.setdefault(medium, []).append((block_hash(key), page))
        for medium, pages in by_medium.items():
            run: list[tuple[int, _Page]] = []
            for h, page in pages:
                if run and page.parent != run[-1][0]:
                    events.append(self._stored(run, medium))
                    run = []
                run.append((h, page))
            if run:
                events.append(self._stored(run, medium))
        if events:
            self.stored_events += len(events)
            self._put(events)

    def _stored(self, run: list[tuple[int, _Page]], medium: Medium) -> BlockStored:
        tokens: list[int] = []
        for _, page in run:
            tokens += page.tokens
        return BlockStored(
            [h for h, _ in run], run[0][1].parent, tokens, self.page_size, medium.medium, medium.locality,
            medium.ownership,
        )

    def _emit_removed(self, gone: list[tuple[int, Medium]]) -> None:
        by_medium: dict[Medium, list[int]] = {}
        for h, medium in gone:
            by_medium.setdefault(medium, []).append(h)
        events: list[KVEvent] = [BlockRemoved(hashes, m.medium, m.locality, m.ownership) for m, hashes in by_medium.items()]
        if events:
            self.removed_events += len(events)
            self._put(events)

    def _put(self, events: list[KVEvent]) -> None:
        if self._lost:
            self._resync()
            if self._lost:
                return  # still no room: the clean slate to come covers these
        if not self.sink.put(events):
            self._lost = True

    def _resync(self) -> None:
        """A clean slate and every page that holds now, once the sink has room for all of it."""
        by_medium: dict[Medium, list[BlockStored]] = {}
        for key, page in self._pages.items():
            if not page.announced:
                continue
            for medium in page.held:
                by_medium.setdefault(medium, []).append(BlockStored(
                    [block_hash(key)], page.parent, page.tokens, self.page_size, medium.medium, medium.locality,
                    medium.ownership,
                ))
        events: list[KVEvent] = [AllBlocksCleared()] if self.clean_slate else []
        for stored in by_medium.values():
            events += stored
        if self.sink.has_room(len(events)) and self.sink.put(events):
            self._lost = False
            self.resyncs += 1
