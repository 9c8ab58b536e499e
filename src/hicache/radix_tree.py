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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .keys import TOKEN_BYTES, TokenBytes, chain_keys

__all__ = ["TreeNode", "HiRadixTree", "MatchResult", "Pin"]

_ids = itertools.count(1)


class TreeNode:
    """A run of whole pages. See the module docstring for the invariants."""

    __slots__ = (
        "id",
        "parent",
        "children",
        "tokens",
        "keys",
        "device",
        "host",
        "loading",
        "backing_up",
        "storing",
        "stored",
        "store_failed",
        "source",
        "lock_ref",
        "lease_ref",
        "hit_count",
        "last_access",
        "created",
        "priority",
    )

    def __init__(self, parent: TreeNode | None, tokens: TokenBytes, keys: list[bytes]) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.tokens = tokens
        self.keys = keys
        self.device: list[int] | None = None
        self.host: list[int] | None = None
        self.loading: Any = None  # the LoadJob filling ``device`` while it is in flight
        self.backing_up = False  # a backup of this node to host is in flight
        self.storing = False  # a write of its host pages to storage is in flight: keep them
        self.stored = False  # its pages were written to (or read from) storage; a hint (storage is lossy)
        self.store_failed = False  # a write of its pages to storage failed: it may leave the host, counted as lost
        self.source: str | None = None  # the storage tier its host pages came from, until first used
        self.lock_ref = 0
        self.lease_ref = 0  # the part of lock_ref held by callers (leases), not by background jobs
        self.hit_count = 0
        self.last_access = time.monotonic()
        self.created = self.last_access
        self.priority = 0

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def evictable(self) -> bool:
        return self.lock_ref == 0 and self.loading is None and not self.backing_up

    def has_device_child(self) -> bool:
        return any(c.device is not None for c in self.children.values())

    def __repr__(self) -> str:
        where = "".join(t for t, v in (("D", self.device), ("H", self.host)) if v is not None) or "-"
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
        lease = 0 if job else 1
        cur: TreeNode | None = node
        while cur is not None:
            cur.lock_ref += 1
            cur.lease_ref += lease
            cur = cur.parent

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        lease = 0 if self.job else 1
        cur: TreeNode | None = self.node
        while cur is not None:
            cur.lock_ref -= 1
            cur.lease_ref -= lease
            assert cur.lock_ref >= 0 and cur.lease_ref >= 0, "pin released twice"
            cur = cur.parent


class HiRadixTree:
    """Page-granular radix tree over token ids (stored as int64 bytes)."""

    def __init__(self, page_size: int, namespace_digest: bytes) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.seed = namespace_digest
        self.root = TreeNode(None, b"", [])
        self.root.lock_ref = 1  # the root is never evicted

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

    def split(self, node: TreeNode, at_pages: int) -> TreeNode:
        """Split ``node`` after ``at_pages`` pages; return the new prefix node (the new parent)."""
        assert 0 < at_pages < node.num_pages
        pb = self.page_bytes
        parent = node.parent
        assert parent is not None
        prefix = TreeNode(parent, node.tokens[: at_pages * pb], node.keys[:at_pages])
        prefix.device = node.device[:at_pages] if node.device is not None else None
        prefix.host = node.host[:at_pages] if node.host is not None else None
        prefix.loading = node.loading
        prefix.backing_up = node.backing_up
        prefix.storing = node.storing
        prefix.stored = node.stored
        prefix.store_failed = node.store_failed
        prefix.source = node.source
        # Every pin on ``node`` walks through its parent chain, so the new parent carries them all.
        prefix.lock_ref = node.lock_ref
        prefix.lease_ref = node.lease_ref
        prefix.hit_count = node.hit_count
        prefix.last_access = node.last_access
        prefix.created = node.created
        prefix.priority = node.priority
        parent.children[node.tokens[:pb]] = prefix
        node.tokens = node.tokens[at_pages * pb :]
        node.keys = node.keys[at_pages:]
        node.device = node.device[at_pages:] if node.device is not None else None
        node.host = node.host[at_pages:] if node.host is not None else None
        node.parent = prefix
        prefix.children[node.tokens[:pb]] = node
        return prefix

    # -- insertion ------------------------------------------------------------------------------

    def extend(self, parent: TreeNode, tokens: TokenBytes) -> TreeNode:
        """Add a child of ``parent`` covering ``tokens`` (whole pages not yet in the tree)."""
        pb = self.page_bytes
        assert tokens and len(tokens) % pb == 0
        first = tokens[:pb]
        assert first not in parent.children, "extend() over an existing child"
        seed = parent.keys[-1] if parent.keys else self.seed
        node = TreeNode(parent, tokens, chain_keys(seed, tokens, self.page_size))
        parent.children[first] = node
        return node

    def remove(self, node: TreeNode) -> None:
        """Unlink a childless, unpinned node that holds no pages any more."""
        assert not node.children and node.lock_ref == 0
        assert node.device is None and node.host is None
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[: self.page_bytes]]
        node.parent = None

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
            assert cur.keys == keys[end - n : end], "job pages no longer match the tree"
            out.append((cur, end - n, end))
            end -= n
            cur = cur.parent
        return out
