"""SGLang's sliding-window host pool (``swa``): its pages stored beside the KV pages (HiCache v2).

For a sliding-window hybrid (gpt-oss, Gemma 4, ...) SGLang 0.5.23 keeps two host pools under its
``HybridCacheController``: ``kv`` (the full-attention layers, every token) and ``swa`` (the sliding
layers). What its storage interface v2 asks of a backend for ``swa`` (``hicache_storage.py``,
``hybrid_cache/hybrid_cache_controller.py``; the details with line numbers in docs/models.md):

* ``register_mem_host_pool_v2(pool, "swa")`` at attach, after ``register_mem_pool_host(kv pool)``;
* backup: ``batch_set_v2`` with the ``swa`` pages of the window before a node's end, each keyed by
  the KV page hash of the same tokens, *before* the KV pages go through ``batch_set_v1``;
* prefetch: ``batch_exists_v2(keys, [swa, TRAILING_PAGES, one key per window page])`` answers the
  prefix lengths (in pages) that can be restored: every KV page before the end, and the ``swa``
  pages of the last ``window`` pages; then the KV pages are read (v1) and, only when all of them
  landed, ``batch_get_v2`` reads the ``swa`` pages of the window before the hit's end. A short
  ``swa`` read discards the whole prefetch on SGLang's side (all or nothing), so it is never
  served in part.

``SlidingPool`` stores those pages through the KV pages' own storage tiers (each tier's backend,
shared, opened and closed with the KV tiers), sealed like KV pages but with a codec of their own:
the pool's geometry (its layers and heads) in every header, and a namespace variant for the pool
(``PageCodec.part``), so a ``swa`` page is never read as a KV page or as another pool's, layout's
or tenant's page; with a tenant key its names and MACs derive from that tenant's subkeys. Every
page read is verified; a corrupt one is a miss, deleted from the tier and counted.

``restorable_ends`` is the one rule for which prefix lengths a pool can restore: a missing page
(absent, deleted, or dropped as corrupt) removes every length whose window covers it, never more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ...errors import UnsupportedModelError
from ...tiers.storage.tier import StorageTier
from .chain import StorageChain
from .host_pages import HostPages

__all__ = ["SlidingPool", "restorable", "restorable_ends"]


class SlidingPool:
    """One SGLang sidecar host pool (``swa``) and the tiers its pages are stored in."""

    def __init__(self, name: str, pages: HostPages, chain: StorageChain) -> None:
        self.name = name
        self.pages = pages
        self.chain = chain

    @classmethod
    def over(cls, name: str, host_pool: Any, *, kv: HostPages, kv_chain: StorageChain, attention: str) -> SlidingPool:
        """The pool's pages through ``kv_chain``'s backends; refused (``UnsupportedModelError``) when
        its pages cannot be laid out as the KV pool's are (another class, layout, page size, dtype)."""
        kind, anchor = type(host_pool).__name__, kv.pool
        if kind != type(anchor).__name__:
            raise UnsupportedModelError(
                f"SGLang host pool {name!r} is a {kind}, the KV pool a {type(anchor).__name__}: hicache's backend "
                "stores a sliding-window pool laid out as the KV pool only"
            )
        for what in ("layout", "page_size", "dtype"):
            if getattr(host_pool, what, None) != getattr(anchor, what, None):
                raise UnsupportedModelError(
                    f"SGLang host pool {name!r}: {what} {getattr(host_pool, what, None)!r} differs from the KV "
                    f"pool's {getattr(anchor, what, None)!r}; hicache's backend keys its pages by the KV pages'"
                )
        pages = HostPages(host_pool, attention=attention)
        if attention == "mla":
            heads, head_dim = 1, int(host_pool.kv_cache_dim)
        else:
            heads, head_dim = int(host_pool.head_num), int(host_pool.head_dim)
            if int(getattr(host_pool, "v_head_dim", head_dim)) != head_dim:
                raise UnsupportedModelError(f"SGLang host pool {name!r}: K head dim {head_dim} != V head dim")
        # The pool's own slice of layers is in its namespace (the KV namespace holds the KV pool's).
        part = f"sglang-pool:{name}:layers={int(getattr(host_pool, 'start_layer', 0) or 0)}+{int(host_pool.layer_num)}"
        tiers = []
        for tier in kv_chain.tiers:
            geometry = dataclasses.replace(
                tier.codec.geometry, num_layers=int(host_pool.layer_num), num_kv_heads=heads, head_dim=head_dim
            )
            if geometry.page_bytes != pages.page_bytes:
                raise UnsupportedModelError(
                    f"SGLang host pool {name!r}: pages of {pages.page_bytes} bytes, its geometry says "
                    f"{geometry.page_bytes}"
                )
            codec = dataclasses.replace(
                tier.codec, geometry=geometry, part="|".join(filter(None, (tier.codec.part, part)))
            )
            tiers.append(StorageTier(
                f"{tier.name}.{name}", tier.backend, codec, None, batch_pages=tier.batch_pages,
                codec_threads=tier.codec_threads,
            ))
        chain = StorageChain(
            tiers, page_size=kv_chain.page_size, page_bytes=pages.page_bytes, writes=kv_chain.writes,
            timeout_s=kv_chain.timeout_s,
        )
        return cls(name, pages, chain)

    def close(self) -> None:
        """Stop the pool's codec threads. Its backends are the KV tiers': they close with those."""
        for tier in self.chain.tiers:
            pool, tier._pool = tier._pool, None  # as LayerSplitTier does for its sliding part
            if pool is not None:
                pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"<SlidingPool {self.name} over {', '.join(t.name for t in self.chain.tiers)}>"


async def restorable_ends(chain: StorageChain, keys: Sequence[bytes], end: int, window: int | None) -> list[int]:
    """Prefix lengths ``1..end`` (pages, ascending) whose last ``window`` pages (all pages before it:
    ``None``) ``chain`` holds: SGLang's ``TRAILING_PAGES`` (``ALL_PAGES``) rule, page by page.

    Walks down from ``end``: a window with a page missing moves the end to that page (no window may
    cover it); a whole window extends back over the run of pages held before it, and every end whose
    window lies inside that run is restorable. Two lookups per run of held pages, not one per page.
    """
    ends: list[int] = []
    while end > 0:
        low = 0 if window is None else max(0, end - window)
        have = await chain.exists(keys[low:end])
        if have < end - low:
            end = low + have
            continue
        start = low - (await chain.exists(list(reversed(keys[:low]))) if low else 0)
        shortest = 1 if start == 0 or window is None else start + window
        ends.extend(range(end, shortest - 1, -1))
        end = start - 1  # page start - 1 is missing (or start == 0: nothing is left below)
    ends.reverse()
    return ends


async def restorable(
    kv_chain: StorageChain, keys: Sequence[bytes], wanted: Sequence[tuple[str, SlidingPool, int | None]]
) -> tuple[int, dict[str, list[int]]]:
    """The KV pages held from the start, and for each ``(name, pool, window)`` the prefix lengths
    (up to those KV pages) it can restore (``restorable_ends``)."""
    kv = await kv_chain.exists(keys)
    return kv, {name: await restorable_ends(pool.chain, keys, kv, window) for name, pool, window in wanted}
