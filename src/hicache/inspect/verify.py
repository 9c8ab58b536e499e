"""``hicache inspect verify [--repair]``: read every page and check it as far as the config allows.

Per page (``page_format.check_stored_page``): ``ok`` (header and checksum, or for the config's own
keyed pages the MAC, verified), ``corrupt`` (proven bad: unreadable, not a hicache page, stored
under another name, truncated, wrong checksum or MAC), ``unverifiable`` (a keyed page of another
tenant key or namespace: neither proven good nor bad, never removed). ``--repair`` removes the
corrupt ones; a page rewritten by a live cache between the read and the removal is removed too,
which costs that cache a miss, never wrong data.

A page is read whole, so an object larger than any page the config's geometry can make
(``largest_page_bytes``: a header and the widest codec chain's bound) is not read at all: it is
reported as ``oversized`` (skipped, never removed: it may be a larger model's page in a shared
tier, read with ``--max-page-bytes``). A 4 GiB file planted in a file tier's folder costs a
listing entry, not 4 GiB of memory and reading.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..tiers.storage.base import StorageBackend
from ..tiers.storage.codecs.aes_gcm import AesGcm
from ..tiers.storage.codecs.lossless import Lossless
from ..tiers.storage.page_format import HEADER_BYTES, PageCodec, check_stored_page, page_codecs
from .walk import batches, list_all, progress

__all__ = ["CorruptPage", "VerifyReport", "largest_page_bytes", "verify"]


def largest_page_bytes(codec: PageCodec | tuple[PageCodec, ...]) -> int:
    """The largest stored page of ``codec``'s geometry: a header and the larger of what its own chain
    and the widest chain (``lossless`` then ``aes-gcm`` over the exact KV) can store, so pages this
    model wrote through another chain are still read. Both bounds are the stages' own
    (``max_encoded_bytes``, which needs no key or library: computed on bare instances). A
    layer-split tier: the largest of its parts'."""
    largest = 0
    for c in page_codecs(codec):
        widest = c.payload_bytes
        for stage in (object.__new__(Lossless), object.__new__(AesGcm)):
            widest = stage.max_encoded_bytes(widest)
        largest = max(largest, HEADER_BYTES + max(c.max_stored_bytes, widest))
    return largest


@dataclass(frozen=True)
class CorruptPage:
    name: str  # the storage name, hex
    reason: str
    bytes: int | None


@dataclass
class VerifyReport:
    tier: str
    kind: str
    pages: int = 0
    ok: int = 0
    ours: int = 0  # of the ok pages, the config's own (namespace and key)
    unverifiable: int = 0
    corrupt: list[CorruptPage] = field(default_factory=list)
    removed: int = 0
    repair: bool = False
    max_page_bytes: int = 0  # objects larger are not read (``largest_page_bytes``, or --max-page-bytes)
    oversized: list[CorruptPage] = field(default_factory=list)  # skipped: listed larger than that

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def table(self, limit: int = 20) -> str:
        lines = [
            f"storage tier {self.tier} ({self.kind}): {self.pages - len(self.oversized)} pages read: "
            f"{self.ok} verified "
            f"({self.ours} of this config's namespace), {len(self.corrupt)} corrupt, {self.unverifiable} unverifiable",
        ]
        if self.oversized:
            lines.append(
                f"oversized: {len(self.oversized)} objects larger than {self.max_page_bytes} bytes (the largest page "
                "this config's model can store) were not read; left alone (--max-page-bytes reads larger pages)"
            )
            lines += [f"  {p.name}  {p.bytes} bytes" for p in self.oversized[:limit]]
        reasons: dict[str, int] = {}
        for page in self.corrupt:
            reasons[page.reason] = reasons.get(page.reason, 0) + 1
        if reasons:
            lines.append("corrupt: " + ", ".join(f"{n} {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])))
            lines += [f"  {p.name}  {p.reason}" for p in self.corrupt[:limit]]
            if len(self.corrupt) > limit:
                lines.append(f"  ... {len(self.corrupt) - limit} more (--json lists all)")
        if self.repair:
            lines.append(f"removed {self.removed} corrupt pages")
        elif self.corrupt:
            lines.append("run again with --repair to remove them")
        if self.unverifiable:
            lines.append(
                "unverifiable: keyed pages of another tenant key or model (a reader needs their key); left alone"
            )
        return "\n".join(lines)


async def verify(
    backend: StorageBackend, codec: PageCodec | tuple[PageCodec, ...], tier: str, *, repair: bool = False,
    quiet: bool = False,
    max_page_bytes: int | None = None,
) -> VerifyReport:
    """Check every listed page; ``max_page_bytes`` (default ``largest_page_bytes(codec)``): larger
    objects are reported ``oversized`` and never read."""
    listed = await list_all(backend, quiet=quiet)
    limit = largest_page_bytes(codec) if max_page_bytes is None else max_page_bytes
    report = VerifyReport(tier=tier, kind=backend.kind, pages=len(listed), repair=repair, max_page_bytes=limit)
    pages = []
    for page in listed:
        if page.size is not None and page.size > limit:
            report.oversized.append(CorruptPage(page.key.hex(), "oversized", page.size))
        else:
            pages.append(page)
    with progress(len(pages), "verifying", quiet) as bar:
        for run in batches(pages):
            blobs = await backend.read_stored(run)
            bad: list[bytes] = []
            for page, blob in zip(run, blobs, strict=True):
                found = check_stored_page(codec, page.key, blob)
                if found.status == "ok":
                    report.ok += 1
                    report.ours += found.ours
                elif found.status == "unverifiable":
                    report.unverifiable += 1
                else:
                    report.corrupt.append(CorruptPage(page.key.hex(), found.reason or "corrupt", page.size))
                    bad.append(page.key)
            if repair and bad:
                await backend.delete(bad)
                report.removed += len(bad)
            bar.update(len(run))
    return report
