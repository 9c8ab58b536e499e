"""The index: a page-granular radix tree over token ids, with per-node tier residency.

One tree indexes every memory tier (SGLang's HiRadixCache idea). Each node covers a whole number of
pages and records where those pages live: ``device`` (device page indices) and/or ``host`` (host page
indices). Invariants the controller keeps:

* A node is on the device only if its parent is (or is the root): device residency is prefix-closed,
  because the device only evicts nodes without device-resident children.
* Every non-root node holds at least one copy; a node that loses its last copy is removed, and only
  childless nodes are removed.
* A node with ``lock_ref > 0`` (a lease or an in-flight transfer pins it) is never removed and never
  leaves the device; its host copy may go while the device copy stays (a lease reads the device). A node whose host pages are being written to storage (``storing``) keeps
  them until the write is done, but may leave the device meanwhile.
* Storage residency is not tracked: storage tiers are asked (``exists``) per request, because they
  are shared and lossy. ``stored`` only remembers that this node's pages were written or read. Pins are taken from a node up to the root and released the same way, so a
  split (which puts a new node *above* the split one) keeps the counts consistent.

Splitting keeps the original node object as the suffix and inserts a new parent for the prefix, so
anything holding a node (a pin, a transfer job) still holds the deepest part of what it pinned.

Bookkeeping that must not cost a walk over the tree is kept as the nodes change (see ``HiRadixTree``):
the pages each tier holds under leases (``leased_pages``), each node's count of device-resident
children, the number of nodes, and the list of nodes whose eviction candidacy may have changed
(``changed``), which the evictor's candidate queues consume. So ``device``, ``host`` and ``loading``
are properties whose setters report the change, and pins report leases and unpinned nodes.

Memory: a node keeps its page keys packed in one ``bytes`` (16 bytes a page), and its page indices
as the first page of a run when they are consecutive (``device`` and ``host`` then read as a
``range``), else as an ``array('i')`` (4 bytes a page); leaves share one empty ``children`` mapping.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .keys import KEY_BYTES, TOKEN_BYTES, TokenBytes, chain_keys
from .layer_kinds import restorable_end

__all__ = ["TreeNode", "HiRadixTree", "MatchResult", "Pin", "CHANGED", "NO_CHILDREN"]

_ids = itertools.count(1)

#: ``TreeNode.marks`` bit: the node is in ``HiRadixTree.changed``. Higher bits belong to consumers
#: of that list (the evictor's candidate queues).
CHANGED = 1


#: The children of every leaf: one shared, read-only empty mapping instead of an empty dict each
#: (only this module adds children, and it gives a node its own dict first).
NO_CHILDREN: Mapping[bytes, TreeNode] = MappingProxyType({})


def _pack(pages: Iterable[int], n: int) -> int | array:
    """How a node keeps ``n`` page indices: the first of a run of consecutive pages (what the
    allocator hands out, mostly), else an ``array('i')`` (4 bytes a page)."""
    a = array("i", pages)
    if len(a) == n and n and a[-1] - a[0] == n - 1 and (n <= 2 or a == array("i", range(a[0], a[0] + n))):
        return a[0]
    return a


def _count(stored: int | array | None, n: int) -> int:
    if stored is None:
        return 0
    return n if type(stored) is int else len(stored)


def _cut(stored: int | array | None, at: int) -> tuple[int | array | None, int | array | None]:
    """The stored pages before and from page ``at``."""
    if stored is None:
        return None, None
    if type(stored) is int:
        return stored, stored + at
    head, tail = stored[:at], stored[at:]
    return _pack(head, len(head)), _pack(tail, len(tail))


class TreeNode:
    """A run of whole pages. See the module docstring for the invariants."""

    __slots__ = (
        "id",
        "tree",
        "parent",
        "children",
        "tokens",
        "_keys",
        "_device",
        "_host",
        "_loading",
        "backing_up",
        "storing",
        "writing",
        "stored",
        "store_failed",
        "source",
        "readback_hits",
        "lock_ref",
        "lease_ref",
        "device_children",
        "marks",
        "hit_count",
        "last_access",
        "created",
        "priority",
        "thin",
    )

    def __init__(
        self, tree: HiRadixTree, parent: TreeNode | None, tokens: TokenBytes, keys: bytes | Sequence[bytes]
    ) -> None:
        self.id = next(_ids)
        self.tree = tree
        self.parent = parent
        self.children: Mapping[bytes, TreeNode] = NO_CHILDREN  # a dict once it has any
        self.tokens = tokens
        self._keys = keys if isinstance(keys, bytes) else b"".join(keys)  # KEY_BYTES a page
        self._device: int | array | None = None  # see _pack
        self._host: int | array | None = None
        self._loading: Any = None  # the LoadJob filling ``device`` while it is in flight
        self.backing_up = False  # a backup of this node to host is in flight
        self.storing = 0  # writes to storage in flight that read its host pages: keep them
        self.writing = False  # its own write to storage is in flight (one at a time)
        self.stored = False  # its pages were written to (or read from) storage; a hint (storage is lossy)
        self.store_failed = False  # a write of its pages to storage failed: it may leave the host, counted as lost
        self.source: str | None = None  # the storage tier its host pages came from, until first used
        self.readback_hits = -1  # read back from storage: its hit count then (-1: computed here)
        self.lock_ref = 0
        self.lease_ref = 0  # the part of lock_ref held by callers (leases), not by background jobs
        self.device_children = 0  # children whose ``device`` is set
        self.marks = 0  # bit flags: CHANGED, and the candidate queues the node is in
        self.hit_count = 0
        self.last_access = time.monotonic()
        self.created = self.last_access
        self.priority = 0
        #: Leading pages whose sliding-window layers hold no KV (read back from a storage tier
        #: that keeps those layers only near prefix ends): a hit may pass them, never end near them.
        self.thin = 0

    @property
    def num_pages(self) -> int:
        return len(self._keys) // KEY_BYTES

    @property
    def keys(self) -> list[bytes]:
        """The chained key of each page (a new list; ``key(i)`` for one)."""
        packed = self._keys
        return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]

    def key(self, i: int) -> bytes:
        """The key of page ``i`` (negative counts from the end)."""
        if i < 0:
            i += self.num_pages
        if not 0 <= i < self.num_pages:
            raise IndexError(f"page {i} of a {self.num_pages}-page node")
        return self._keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]

    # -- residency: setters report to the tree --------------------------------------------------

    @property
    def device(self) -> Sequence[int] | None:
        """Device page indices (a ``range`` or an ``array``), or None when not on the device."""
        d = self._device
        if type(d) is int:
            return range(d, d + len(self._keys) // KEY_BYTES)
        return d

    @device.setter
    def device(self, pages: Iterable[int] | None) -> None:
        n = self.num_pages
        old = self._device
        new = None if pages is None else _pack(pages, n)
        self._device = new
        tree = self.tree
        if self.lease_ref:
            tree.leased_pages["device"] += _count(new, n) - _count(old, n)
            if self._host is not None and (old is None) != (new is None):
                # a leased node's host copy is held only while it has no device copy
                tree.leased_pages["host"] += _count(self._host, n) * (1 if new is None else -1)
        if (old is None) != (new is None):
            parent = self.parent
            if parent is not None:
                parent.device_children += 1 if new is not None else -1
                if new is None:
                    tree.note(parent)  # it may have become a device leaf
            if tree.residency_hook is not None:
                tree.residency_hook(self, "device", new is not None)
        tree.note(self)

    @property
    def host(self) -> Sequence[int] | None:
        """Host page indices (a ``range`` or an ``array``), or None when not on the host."""
        h = self._host
        if type(h) is int:
            return range(h, h + len(self._keys) // KEY_BYTES)
        return h

    @host.setter
    def host(self, pages: Iterable[int] | None) -> None:
        n = self.num_pages
        old = self._host
        new = None if pages is None else _pack(pages, n)
        self._host = new
        tree = self.tree
        if self.lease_ref and self._device is None:
            tree.leased_pages["host"] += _count(new, n) - _count(old, n)
        if (old is None) != (new is None) and tree.residency_hook is not None:
            tree.residency_hook(self, "host", new is not None)
        tree.note(self)

    @property
    def on_device(self) -> bool:
        return self._device is not None

    @property
    def on_host(self) -> bool:
        return self._host is not None

    @property
    def loading(self) -> Any:
        """The LoadJob filling ``device`` while it is in flight, else None."""
        return self._loading

    @loading.setter
    def loading(self, job: Any) -> None:
        self._loading = job
        if job is None:
            self.tree.note(self)

    @property
    def evictable(self) -> bool:
        return self.lock_ref == 0 and self._loading is None and not self.backing_up

    def has_device_child(self) -> bool:
        return self.device_children > 0

    def __repr__(self) -> str:
        where = "".join(t for t, v in (("D", self._device), ("H", self._host)) if v is not None) or "-"
        return f"<TreeNode #{self.id} pages={self.num_pages} on={where} lock={self.lock_ref} hits={self.hit_count}>"


@dataclass
class MatchResult:
    """The longest cached prefix of a query, as the path of nodes that holds it.

    ``path`` runs from the root's child down; when ``split`` was not requested the last node may be
    matched only partly (``last_pages`` of its pages).
    """

    path: list[TreeNode] = field(default_factory=list)
    pages: int = 0
    last_pages: int = 0  # pages matched in path[-1]


class Pin:
    """A hold on a node and its ancestors; ``release()`` is idempotent.

    Internal building block of the public leases; always released in a ``finally``. ``job=True``
    marks a background job's pin (a copy that ends by itself): an allocation short of room may wait
    for those, never for a caller's.
    """

    __slots__ = ("node", "job", "_released")

    def __init__(self, node: TreeNode, *, job: bool = False) -> None:
        self.node = node
        self.job = job
        self._released = False
        cur: TreeNode | None = node
        if job:
            while cur is not None:
                cur.lock_ref += 1
                cur = cur.parent
            return
        while cur is not None:
            cur.lock_ref += 1
            if not cur.lease_ref:
                cur.tree.count_lease(cur, 1)
            cur.lease_ref += 1
            cur = cur.parent

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        lease = 0 if self.job else 1
        cur: TreeNode | None = self.node
        while cur is not None:
            cur.lock_ref -= 1
            if lease:
                cur.lease_ref -= 1
                if not cur.lease_ref:
                    cur.tree.count_lease(cur, -1)
            assert cur.lock_ref >= 0 and cur.lease_ref >= 0, "pin released twice"
            if not cur.lock_ref:
                cur.tree.note(cur)  # unpinned: it may be an eviction candidate again
            cur = cur.parent


class HiRadixTree:
    """Page-granular radix tree over token ids (stored as int64 bytes)."""

    def __init__(self, page_size: int, namespace_digest: bytes, *, window_pages: int = 0) -> None:
        self.page_size = page_size
        #: Pages before a hit's end whose sliding layers must hold KV (0: no layer slides).
        self.window_pages = window_pages
        self.page_bytes = page_size * TOKEN_BYTES
        self.seed = namespace_digest
        #: Pages of each tier held by nodes with a lease (``lease_ref > 0``): what waiting for
        #: background jobs can never free. A leased node's host pages count only while it has no
        #: device copy (its host mirror may be evicted; readers use the device pages).
        self.leased_pages = {"device": 0, "host": 0}
        #: Nodes whose eviction candidacy may have changed (residency, pins, children, loads) since
        #: the evictor last looked; each appears once (``CHANGED`` mark). Removed nodes may appear.
        self.changed: list[TreeNode] = []
        self.size = 0  # nodes, the root excluded
        #: Told ``(node, "device" | "host", now_held)`` when a node gains or loses a tier's copy
        #: (splits move pages without telling: nothing changes for them). The KV events listen here.
        self.residency_hook: Callable[[TreeNode, str, bool], None] | None = None
        self.root = TreeNode(self, None, b"", b"")
        self.root.lock_ref = 1  # the root is never evicted

    # -- bookkeeping ----------------------------------------------------------------------------

    def note(self, node: TreeNode) -> None:
        """Record that ``node``'s eviction candidacy may have changed (once until consumed)."""
        if not node.marks & CHANGED:
            node.marks |= CHANGED
            self.changed.append(node)

    def touch(self, path: Iterable[TreeNode]) -> None:
        """A hit on ``path``: each node's hit count and last access (what eviction policies order by)."""
        now = time.monotonic()
        for node in path:
            node.hit_count += 1
            node.last_access = now

    def take_changed(self) -> list[TreeNode]:
        """The nodes noted since the last call (their ``CHANGED`` mark cleared)."""
        changed, self.changed = self.changed, []
        for node in changed:
            node.marks &= ~CHANGED
        return changed

    def count_lease(self, node: TreeNode, sign: int) -> None:
        """``node`` gained (``+1``) or lost (``-1``) its last lease: count its pages in or out."""
        n = node.num_pages
        self.leased_pages["device"] += sign * _count(node._device, n)
        if node._device is None:  # a leased host mirror may go: readers use the device copy
            self.leased_pages["host"] += sign * _count(node._host, n)

    # -- matching -------------------------------------------------------------------------------

    def match(self, tokens: TokenBytes, *, split: bool = False) -> MatchResult:
        """Longest page-aligned prefix of ``tokens`` present in the tree.

        Per-page ``memcmp`` on byte slices, never per-token work. With ``split=True`` a partly
        matched node is split so the result ends on a node boundary.
        """
        pb = self.page_bytes
        total_pages = len(tokens) // pb
        result = MatchResult()
        node = self.root
        pos = 0  # in pages
        while pos < total_pages:
            child = node.children.get(tokens[pos * pb : (pos + 1) * pb])
            if child is None:
                break
            n = child.num_pages
            end = min(pos + n, total_pages)
            if child.tokens[: (end - pos) * pb] == tokens[pos * pb : end * pb]:
                matched = end - pos
            else:
                matched = 1  # the first page matched through the dict
                while matched < n and pos + matched < total_pages and (
                    child.tokens[matched * pb : (matched + 1) * pb]
                    == tokens[(pos + matched) * pb : (pos + matched + 1) * pb]
                ):
                    matched += 1
            if matched < n and split:
                child = self.split(child, matched)
            result.path.append(child)
            result.pages = pos + matched
            result.last_pages = matched
            if matched < child.num_pages:
                break
            node = child
            pos += matched
        return result

    def restorable(self, path: Sequence[TreeNode], pages: int, thin: Iterable[tuple[int, int]] = ()) -> int:
        """How many of the first ``pages`` pages along ``path`` a hit may claim: the longest prefix
        whose window has no thin page (``layer_kinds.restorable_end``); ``thin``: more thin page
        ranges past the path (pages a storage tier would bring back thin)."""
        if not self.window_pages:
            return pages
        ranges = list(thin)
        at = 0
        for node in path:
            if node.thin:
                ranges.append((at, at + node.thin))
            at += node.num_pages
        return restorable_end(pages, ranges, self.window_pages)

    def split(self, node: TreeNode, at_pages: int) -> TreeNode:
        """Split ``node`` after ``at_pages`` pages; return the new prefix node (the new parent)."""
        assert 0 < at_pages < node.num_pages
        pb = self.page_bytes
        kb = at_pages * KEY_BYTES
        parent = node.parent
        assert parent is not None
        prefix = TreeNode(self, parent, node.tokens[: at_pages * pb], node._keys[:kb])
        # Pages move between two nodes that carry the same pins, so lease counts do not change:
        # the slots are set directly, not through the reporting setters.
        dev, host = node._device, node._host
        prefix._device, node._device = _cut(dev, at_pages)
        prefix._host, node._host = _cut(host, at_pages)
        prefix._loading = node._loading
        prefix.backing_up = node.backing_up
        prefix.storing = node.storing
        prefix.writing = node.writing
        prefix.stored = node.stored
        prefix.store_failed = node.store_failed
        prefix.source = node.source
        prefix.readback_hits = node.readback_hits
        # Every pin on ``node`` walks through its parent chain, so the new parent carries them all.
        prefix.lock_ref = node.lock_ref
        prefix.lease_ref = node.lease_ref
        prefix.device_children = 1 if dev is not None else 0  # ``node`` (the parent's count is unchanged)
        prefix.hit_count = node.hit_count
        prefix.last_access = node.last_access
        prefix.created = node.created
        prefix.priority = node.priority
        prefix.thin, node.thin = min(node.thin, at_pages), max(0, node.thin - at_pages)
        parent.children[node.tokens[:pb]] = prefix  # type: ignore[index]  # ``node``'s entry: a dict
        node.tokens = node.tokens[at_pages * pb :]
        node._keys = node._keys[kb:]
        node.parent = prefix
        prefix.children = {node.tokens[:pb]: node}
        self.size += 1
        self.note(prefix)
        self.note(node)
        return prefix

    # -- insertion ------------------------------------------------------------------------------

    def extend(self, parent: TreeNode, tokens: TokenBytes) -> TreeNode:
        """Add a child of ``parent`` covering ``tokens`` (whole pages not yet in the tree)."""
        pb = self.page_bytes
        assert tokens and len(tokens) % pb == 0
        first = tokens[:pb]
        assert first not in parent.children, "extend() over an existing child"
        seed = parent._keys[-KEY_BYTES:] if parent._keys else self.seed
        node = TreeNode(self, parent, tokens, chain_keys(seed, tokens, self.page_size))
        if parent.children is NO_CHILDREN:
            parent.children = {}
        parent.children[first] = node  # type: ignore[index]
        self.size += 1
        return node

    def remove(self, node: TreeNode) -> None:
        """Unlink a childless, unpinned node that holds no pages any more."""
        assert not node.children and node.lock_ref == 0
        assert node._device is None and node._host is None
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[: self.page_bytes]]  # type: ignore[attr-defined]
        if not parent.children:
            parent.children = NO_CHILDREN
        node.parent = None
        self.size -= 1
        self.note(parent)  # it may have become a host leaf

    # -- traversal ------------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_to(self, node: TreeNode | None) -> list[TreeNode]:
        """Nodes from the root's child down to ``node`` (re-derived: splits may have added some)."""
        path: list[TreeNode] = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    @staticmethod
    def covering(node: TreeNode, keys: list[bytes]) -> list[tuple[TreeNode, int, int]]:
        """The nodes that now hold the pages ``keys`` that ``node`` held when a job started.

        Splits since then may have moved a prefix of those pages into new parents; walk up and
        return ``(node, start, end)`` slices into ``keys``, deepest first.
        """
        out: list[tuple[TreeNode, int, int]] = []
        end = len(keys)
        cur: TreeNode | None = node
        while end > 0:
            assert cur is not None and cur.parent is not None
            n = cur.num_pages
            assert cur._keys == b"".join(keys[end - n : end]), "job pages no longer match the tree"
            out.append((cur, end - n, end))
            end -= n
            cur = cur.parent
        return out
