"""What SGLang's ``clear`` removes: this rank's pages, not every page of a shared tier.

SGLang calls ``clear()`` on its storage backend when ``/hicache/storage-backend/clear`` is asked
(open to anyone who reaches its HTTP port unless ``--admin-api-key`` is set). A storage tier is
often shared: by the ranks of other engines, other models and layouts, other tenants. The
backend's ``clear`` setting says how far a clear reaches:

* ``namespace`` (default): the pages of this rank's namespace only, found as ``hicache inspect
  purge --namespace this`` finds them: the tier is listed and each page's header read; a page
  whose namespace field is this codec's is removed. With a tenant key that field derives from the
  key (``PageCodec``), so nobody else's page can match, and nothing but the header is read. A tier
  that cannot list its pages is left whole, and the log says so;
* ``all``: every page of every tier, whoever wrote it (a backend's own ``clear``);
* ``off``: nothing.

A rank that does not write storage (``Namespace.writes_storage``: MLA ranks but 0 share rank 0's
pages) removes nothing: rank 0 clears those pages. Every backend call is bounded by the backend's
``timeout_s``; a tier that fails is logged and the others are still cleared.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import HiCacheError, ListingUnsupportedError
from ...tiers.storage.page_format import parse_header
from ...tiers.storage.tier import StorageTier

__all__ = ["TierCleared", "clear_tiers", "namespace_pages"]

log = logging.getLogger("hicache.sglang")

@dataclass(frozen=True)
class TierCleared:
    """What a clear did to one tier: pages listed and removed (``None``: not known, or not listed)."""

    tier: str
    listed: int | None
    removed: int | None
    why_not: str | None = None  # set when the tier was left as it was


async def namespace_pages(tier: StorageTier) -> tuple[list[bytes], int]:
    """The storage names of the pages of ``tier`` whose header carries this tier's namespace (and
    page format), and how many entries were listed."""
    codec, backend = tier.codec, tier.backend
    ours = codec._namespace_field  # as `inspect purge --namespace this` selects them
    mine: list[bytes] = []
    listed = 0
    async for batch in backend.list_pages():
        listed += len(batch)
        for page, raw in zip(batch, await backend.read_headers(batch), strict=True):
            info = parse_header(raw) if raw is not None else None
            if info is not None and info.namespace == ours and info.version == codec.version:
                mine.append(page.key)
    return mine, listed


async def clear_tiers(tiers: Sequence[StorageTier], scope: str, *, writes: bool) -> list[TierCleared]:
    """Clear ``tiers`` as ``scope`` (``namespace``, ``all``, ``off``) says; what each tier saw."""
    if scope == "off" or not writes:
        why = "clear: off" if scope == "off" else "this rank does not write storage (rank 0 clears these pages)"
        return [TierCleared(t.name, None, None, why) for t in tiers]
    out = []
    for tier in tiers:
        try:
            if scope == "all":
                await tier.backend.clear()
                out.append(TierCleared(tier.name, None, None))
                continue
            mine, listed = await namespace_pages(tier)
            # Removed after the listing: a backend's listing need not survive deletes under it.
            for start in range(0, len(mine), tier.backend.max_batch):
                await tier.backend.delete(mine[start : start + tier.backend.max_batch])
            out.append(TierCleared(tier.name, listed, len(mine)))
        except ListingUnsupportedError:
            out.append(TierCleared(
                tier.name, None, None, f"the {tier.backend.kind} backend cannot list its pages, so this rank's "
                "cannot be told from others' (the backend's `clear: all` removes every page)",
            ))
        except (HiCacheError, OSError) as exc:
            out.append(TierCleared(tier.name, None, None, f"failed: {type(exc).__name__}: {exc}"))
    return out
