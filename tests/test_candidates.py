"""Incremental bookkeeping of the index against brute-force scans, under random programs.

A random program inserts token sequences (sharing prefixes, so nodes split), moves pages on and off
the device and host, pins and unpins (leases and jobs), starts and ends loads, touches nodes and
removes emptied ones, as the controller does. After every step the counters the tree keeps as nodes
change (leased pages per tier, device children, node count) must equal a scan of the whole tree,
and whenever it is asked, each candidate queue must yield exactly the node a full sort of the
current candidates by the policy's key would put first (``evictor.py`` evicted that way before).
"""

from __future__ import annotations

import itertools
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.controller.candidates import (
    _QUEUED,
    DEVICE_LEAF,
    HOST_LEAF,
    HOST_MIRROR,
    Candidates,
    device_leaf,
    host_leaf,
    host_mirror,
)
from hicache.keys import KEY_BYTES
from hicache.policies.eviction import FIFOPolicy, LFUPolicy, LRUPolicy, PriorityPolicy, ScanResistantLRUPolicy
from hicache.radix_tree import CHANGED, HiRadixTree, Pin, TreeNode

PS = 2
# Sequences of 1-4 pages over few page patterns, so they share prefixes and diverge inside nodes.
SEQUENCES = [
    [0, 0], [0, 0, 0, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 2, 0, 1, 1], [0, 0, 1, 1, 0, 0],
    [1, 1], [1, 1, 2, 0], [1, 1, 2, 0, 0, 0, 0, 1], [2, 0, 0, 1],
]
WANTED = {DEVICE_LEAF: device_leaf, HOST_LEAF: host_leaf, HOST_MIRROR: host_mirror}
POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy, "priority": PriorityPolicy,
            "scan_resistant_lru": ScanResistantLRUPolicy}


def tb(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


def brute_leased(tree: HiRadixTree) -> dict[str, int]:
    out = {"device": 0, "host": 0}
    for node in tree.nodes():
        if node.lease_ref > 0:
            out["device"] += len(node.device or ())
            if node.device is None:  # a leased node's host mirror may be evicted
                out["host"] += len(node.host or ())
    return out


def check_counters(tree: HiRadixTree, candidates: Candidates | None = None) -> None:
    nodes = list(tree.nodes())
    assert tree.size == len(nodes)
    assert tree.leased_pages == brute_leased(tree)
    for node in [tree.root, *nodes]:
        assert node.device_children == sum(c.device is not None for c in node.children.values())
    if candidates is None:
        return
    # What makes every pop exact: each candidate is queued, or reported and not yet refreshed; a
    # queued bit means one entry in that heap; a queued key is never later than the current one.
    for kind, wanted in WANTED.items():
        heap = candidates._heaps[kind]
        entries = {}
        for entry in heap:
            node = entry[-1]
            assert node.id not in entries, "a node queued twice"
            entries[node.id] = candidates._queued_key(entry)
        bit = _QUEUED[kind]
        for node in nodes:
            assert bool(node.marks & bit) == (node.id in entries)
            if node.id in entries:
                assert entries[node.id] <= candidates.policy.key(node)
            if wanted(node):
                assert node.marks & (bit | CHANGED), f"{node!r} is a candidate of kind {kind} nobody knows of"


class Program:
    """Applies random steps to a tree the way the controller would (residency rules kept)."""

    def __init__(self, policy_name: str) -> None:
        self.tree = HiRadixTree(PS, b"\0" * KEY_BYTES)
        self.policy = POLICIES[policy_name]()
        self.candidates = Candidates(self.tree, self.policy)
        self.pins: list[Pin] = []
        self.pages = itertools.count()
        self.clock = itertools.count(1)

    def nodes(self) -> list[TreeNode]:
        return sorted(self.tree.nodes(), key=lambda n: n.id)

    def pick(self, i: int) -> TreeNode | None:
        nodes = self.nodes()
        return nodes[i % len(nodes)] if nodes else None

    def fresh(self, n: int) -> list[int]:
        pages = [next(self.pages) for _ in range(n)]
        return pages[::-1] if pages[0] % 3 == 0 else pages  # runs, and not (kept two ways)

    def step(self, op: str, a: int, b: int) -> None:
        tree = self.tree
        if op == "insert":
            ids = SEQUENCES[a % len(SEQUENCES)]
            match = tree.match(tb(ids), split=True)
            parent = match.path[-1] if match.path else tree.root
            rest = tb(ids)[match.pages * PS * 8 :]
            if not rest:
                return
            node = tree.extend(parent, rest)
            if parent is tree.root or parent.device is not None:
                node.device = self.fresh(node.num_pages)
                if b % 3 == 0:
                    node.host = self.fresh(node.num_pages)
            else:
                node.host = self.fresh(node.num_pages)
                if b % 2:  # read back from storage (as a prefetch publishes it)
                    node.readback_hits = node.hit_count
            node.priority = b % 3 - 1  # set once, right after the pages (as Placement.insert_pages does)
            return
        node = self.pick(a)
        if node is None:
            return
        if op == "drop_device":
            # as the evictor: a node keeps some copy while it has children (it spills first)
            if (
                node.device is not None and not node.device_children and node.lock_ref == 0
                and (node.host is not None or not node.children)
            ):
                node.device = None
                self._remove_if_empty(node)
        elif op == "drop_host":
            if node.host is not None and node.lock_ref == 0 and (node.device is not None or not node.children):
                node.host = None
                self._remove_if_empty(node)
        elif op == "add_host":
            if node.host is None:
                node.host = self.fresh(node.num_pages)
        elif op == "add_device":
            if node.device is None and (node.parent is tree.root or node.parent.device is not None):
                node.device = self.fresh(node.num_pages)
        elif op == "pin":
            self.pins.append(Pin(node, job=bool(b % 2)))
        elif op == "release":
            if self.pins:
                self.pins.pop(b % len(self.pins)).release()
        elif op == "load":
            node.loading = None if node.loading is not None else object()
        elif op == "touch":
            node.hit_count += 1
            node.last_access = float(next(self.clock)) + 1e9  # later than any creation time
        elif op == "split":
            if node.num_pages > 1:
                tree.split(node, 1 + b % (node.num_pages - 1))

    def _remove_if_empty(self, node: TreeNode) -> None:
        if node.device is None and node.host is None:
            assert not node.children and node.lock_ref == 0
            self.tree.remove(node)

    def check_pop(self, kind: int) -> None:
        """The queue's next victim is the brute-force minimum; then it is handed back (``note``)."""
        self.candidates.refresh()
        wanted = WANTED[kind]
        expected = min(((self.policy.key(n), n.id, n) for n in self.tree.nodes() if wanted(n)), default=None)
        got = self.candidates.pop(kind)
        if expected is None:
            assert got is None
            return
        assert got is expected[2], f"kind {kind}: got {got!r}, expected {expected[2]!r}"
        self.tree.note(got)


OPS = ["insert", "insert", "drop_device", "drop_host", "add_host", "add_device", "pin", "release", "load", "touch",
       "touch", "split", "pop", "pop", "pop", "refresh"]
program_st = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 63), st.integers(0, 63)), min_size=8, max_size=60)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=program_st)
def test_queues_and_counters_agree_with_brute_force(policy: str, steps: list[tuple[str, int, int]]) -> None:
    prog = Program(policy)
    for op, a, b in steps:
        if op == "pop":
            prog.check_pop(a % 3)
        elif op == "refresh":  # the evictor refreshes on every allocation
            prog.candidates.refresh()
        else:
            prog.step(op, a, b)
        check_counters(prog.tree, prog.candidates)
    for pin in prog.pins:
        pin.release()
    check_counters(prog.tree)
    assert prog.tree.leased_pages == {"device": 0, "host": 0}
    # Drain every queue: the full order must be the sorted order of the candidates.
    prog.candidates.refresh()
    for kind, wanted in WANTED.items():
        expected = sorted((prog.policy.key(n), n.id) for n in prog.tree.nodes() if wanted(n))
        order = []
        while (node := prog.candidates.pop(kind)) is not None:
            order.append((prog.policy.key(node), node.id))
        assert order == expected


def test_removed_nodes_do_not_pile_up_in_the_queues() -> None:
    """Entries of removed nodes are dropped once they could outnumber live ones."""
    prog = Program("lru")
    for i in range(2000):
        node = prog.tree.extend(prog.tree.root, tb([i, i]))
        node.device = [i]
        node.host = [i]
        prog.candidates.refresh()  # queued as a device leaf and as a host mirror
        node.device = None
        node.host = None
        prog.tree.remove(node)
    prog.candidates.refresh()
    assert prog.tree.size == 0 and len(prog.candidates) <= 2 * 64 + 3


def test_keys_are_packed_and_page_lists_compact() -> None:
    tree = HiRadixTree(PS, b"\0" * KEY_BYTES)
    node = tree.extend(tree.root, tb([1, 2, 3, 4, 5, 6]))
    assert node.num_pages == 3 and len(node.keys) == 3 and node.key(-1) == node.keys[2]
    node.device = [7, 8, 9]  # a run: kept as its first page
    node.host = [5, 3, 9]  # not a run: kept as int32
    assert node.device == range(7, 10) and list(node.host) == [5, 3, 9] and node.host.itemsize == 4
    prefix = tree.split(node, 1)
    assert list(prefix.device) == [7] and list(node.device) == [8, 9]
    assert list(prefix.host) == [5] and list(node.host) == [3, 9]
    pin = Pin(node)
    node.host = [20, 21]
    # host copies of leased nodes still on the device are mirrors that may go: not counted held
    assert tree.leased_pages == {"device": 3, "host": 0}
    prefix.device = None
    assert tree.leased_pages == {"device": 2, "host": 1}
    node.device = None
    node.host = [20, 21]
    assert tree.leased_pages == {"device": 0, "host": 3}
    pin.release()
    assert tree.leased_pages == {"device": 0, "host": 0}
    assert tree.covering(node, prefix.keys + node.keys) == [(node, 1, 3), (prefix, 0, 1)]


def _queued_or_reported(prog: Program, node: TreeNode, kind: int) -> bool:
    return bool(node.marks & (_QUEUED[kind] | CHANGED))


@pytest.mark.parametrize("event", ["child_device_dropped", "child_removed", "load_ended", "pin_released"])
def test_each_event_that_makes_a_candidate_is_reported(event: str) -> None:
    """A node that was skipped while it was no candidate is queued again when it becomes one."""
    prog = Program("lru")
    tree = prog.tree
    parent = tree.extend(tree.root, tb([0, 0]))
    child = tree.extend(parent, tb([0, 1]))
    kind = DEVICE_LEAF
    if event == "child_removed":
        parent.host, child.host = [1], [2]  # host-only chain: the parent is a host leaf once alone
        kind = HOST_LEAF
    else:
        parent.device, child.device = [1], [2]
        child.host = [3]
    pin = Pin(parent, job=True) if event == "pin_released" else None
    if event == "load_ended":
        parent.loading = object()
    prog.candidates.refresh()
    prog.check_pop(kind)  # the child: the parent is no candidate yet (skipped, not queued)
    assert not _queued_or_reported(prog, parent, kind)
    if event == "child_device_dropped":
        child.device = None  # still on the host: the child stays, the parent is a device leaf now
    elif event == "child_removed":
        child.host = None
        tree.remove(child)
    elif event == "load_ended":
        child.device = None
        prog.candidates.refresh()
        prog.check_pop(kind)  # still loading: no candidate
        parent.loading = None
    else:
        child.device = None
        prog.candidates.refresh()
        prog.check_pop(kind)  # still pinned: no candidate
        assert pin is not None
        pin.release()
    check_counters(tree, prog.candidates)
    prog.check_pop(kind)  # the parent, now
