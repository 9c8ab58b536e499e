"""The radix index and page keys."""

from __future__ import annotations

from array import array

import pytest

from hicache.containers import namespace_from_config
from hicache.keys import KEY_BYTES, as_token_bytes, chain_keys
from hicache.radix_tree import HiRadixTree, Pin

from .conftest import make_config

PS = 4


def tb(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


def tree_with(*seqs: list[int]) -> HiRadixTree:
    tree = HiRadixTree(PS, b"\0" * KEY_BYTES)
    for ids in seqs:
        m = tree.match(tb(ids), split=True)
        parent = m.path[-1] if m.path else tree.root
        rest = tb(ids)[m.pages * PS * 8 : (len(ids) // PS) * PS * 8]
        if rest:
            node = tree.extend(parent, rest)
            node.device = list(range(node.num_pages))
    return tree


def test_match_is_page_aligned_and_splits_on_demand() -> None:
    tree = tree_with(list(range(12)))
    assert tree.match(tb(list(range(10)))).pages == 2  # 2 full pages of the query
    m = tree.match(tb(list(range(8)) + [99, 99, 99, 99]))
    assert (m.pages, m.last_pages, len(m.path)) == (2, 2, 1)
    assert len(list(tree.nodes())) == 1  # lookup does not split
    m = tree.match(tb(list(range(8)) + [99, 99, 99, 99]), split=True)
    assert m.pages == 2 and m.path[-1].num_pages == 2
    assert [n.num_pages for n in tree.nodes()] == [2, 1]


def test_split_keeps_keys_chained_and_pins_consistent() -> None:
    tree = tree_with(list(range(12)))
    (node,) = tree.nodes()
    keys = list(node.keys)
    pin = Pin(node)
    prefix = tree.split(node, 1)
    assert prefix.keys + node.keys == keys and prefix.lock_ref == 1 and node.parent is prefix
    assert tree.covering(node, keys) == [(node, 1, 3), (prefix, 0, 1)]
    pin.release()
    assert prefix.lock_ref == node.lock_ref == 0
    pin.release()  # idempotent
    assert prefix.lock_ref == 0


def test_chain_keys_depend_on_the_whole_prefix_and_the_namespace() -> None:
    seed = b"\1" * KEY_BYTES
    a = chain_keys(seed, tb([1, 2, 3, 4, 5, 6, 7, 8]), PS)
    b = chain_keys(seed, tb([9, 2, 3, 4, 5, 6, 7, 8]), PS)
    assert len(a) == 2 and a[1] != b[1]  # same second page, different history
    assert chain_keys(b"\2" * KEY_BYTES, tb([1, 2, 3, 4]), PS)[0] != a[0]
    # Continuing a chain from a key equals hashing the whole sequence.
    assert chain_keys(a[0], tb([5, 6, 7, 8]), PS) == a[1:]


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"name": "other"}},
        {"model": {"revision": "v2"}},
        {"model": {"dtype": "float16"}},
        {"model": {"num_layers": 5}},
        {"model": {"head_dim": 16}},
        {"page_size": 8},
        {"tenant_salt": "tenant-b"},
    ],
)
def test_namespace_digest_covers_everything_that_changes_kv(change: dict) -> None:
    base = namespace_from_config(make_config())
    other = namespace_from_config(make_config(**change))
    assert base.digest != other.digest


def test_as_token_bytes_round_trip() -> None:
    assert as_token_bytes([1, 2, 3]) == tb([1, 2, 3])


class CountingBytes(bytes):
    """Bytes that count how often they are sliced (the unit of work in matching)."""

    slices = 0

    def __getitem__(self, key):  # type: ignore[override]
        CountingBytes.slices += 1
        return bytes.__getitem__(self, key)


def test_matching_a_32k_prompt_does_no_per_token_work() -> None:
    """A 32K-token prompt matches in per-page steps (memcmp per page), never per token."""
    ps = 64
    tree = HiRadixTree(ps, b"\0" * KEY_BYTES)
    ids = list(range(32768))
    node = tree.extend(tree.root, tb(ids))
    assert node.num_pages == 512
    node.tokens = CountingBytes(node.tokens)
    CountingBytes.slices = 0
    assert tree.match(tb(ids)).pages == 512  # fast path: one comparison of the whole node
    assert CountingBytes.slices == 1
    CountingBytes.slices = 0
    # Diverging in the last page takes the slow path: page by page, about 2 slices per page.
    assert tree.match(tb(ids[:-1] + [7])).pages == 511
    assert CountingBytes.slices <= 2 * 512 + 2
