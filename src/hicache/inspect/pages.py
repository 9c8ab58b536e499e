"""``hicache inspect pages``: every page of a storage tier, one line each: its codec and the bytes it saves.

Read from the headers alone (nothing verified: ``verify`` does that): the storage name, the
format, the codec chain the page was written through (``-``: none), its stored bytes, its logical
(KV) bytes and the difference, and when it was last used where the backend keeps that.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import format_size
from ..tiers.storage.base import StorageBackend
from ..tiers.storage.page_format import PageCodec, parse_header, writer_codec
from .walk import batches, list_all, progress

__all__ = ["PageLine", "PageListing", "list_page_lines"]


@dataclass(frozen=True)
class PageLine:
    name: str  # the storage name, hex
    format: int | None
    codec: str  # stages applied, comma-separated; "-" for none
    stored_bytes: int | None  # the page as stored (header + payload)
    logical_bytes: int | None  # the KV it holds (header included, as a raw page would be stored)
    last_used: float | None
    ours: bool

    @property
    def saved_bytes(self) -> int | None:
        if self.stored_bytes is None or self.logical_bytes is None:
            return None
        return self.logical_bytes - self.stored_bytes


@dataclass
class PageListing:
    tier: str
    kind: str
    pages: list[PageLine] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(p.saved_bytes or 0 for p in self.pages)

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "kind": self.kind, "saved_bytes": self.saved_bytes,
                "pages": [asdict(p) | {"saved_bytes": p.saved_bytes} for p in self.pages]}

    def table(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        stored = sum(p.stored_bytes or 0 for p in self.pages)
        lines = [f"storage tier {self.tier} ({self.kind}): {len(self.pages)} pages, {format_size(stored)} stored, "
                 f"{format_size(max(self.saved_bytes, 0))} saved by codecs"]
        header = f"{'name':<32}  {'format':>6}  {'codec':<22} {'stored':>10} {'saved':>10}  {'last used':>9}  ours"
        lines += ["", header, "-" * len(header)]
        for p in sorted(self.pages, key=lambda p: p.name):
            saved = "-" if p.saved_bytes is None else (
                format_size(p.saved_bytes) if p.saved_bytes >= 0 else "-" + format_size(-p.saved_bytes))
            used = "-" if p.last_used is None else f"{max(0.0, now - p.last_used):.0f}s"
            size = "-" if p.stored_bytes is None else format_size(p.stored_bytes)
            lines.append(f"{p.name:<32}  {p.format if p.format is not None else '-':>6}  {p.codec:<22} {size:>10} "
                         f"{saved:>10}  {used:>9}  {'yes' if p.ours else 'no'}")
        return "\n".join(lines)


async def list_page_lines(
    backend: StorageBackend, codec: PageCodec | tuple[PageCodec, ...], tier: str, *, quiet: bool = False
) -> PageListing:
    pages = await list_all(backend, quiet=quiet)
    out = PageListing(tier=tier, kind=backend.kind)
    with progress(len(pages), "reading headers", quiet) as bar:
        for run in batches(pages, max_bytes=64 * 1024**2):
            for page, raw in zip(run, await backend.read_headers(run), strict=True):
                info = parse_header(raw) if raw is not None else None
                logical = None if info is None or info.logical_bytes is None else info.logical_bytes + len(raw or b"")
                out.pages.append(PageLine(
                    name=page.key.hex(), format=None if info is None else info.version,
                    codec="-" if info is None or not info.codecs else ",".join(info.codecs),
                    stored_bytes=page.size, logical_bytes=logical, last_used=page.last_used,
                    ours=writer_codec(codec, info) is not None,
                ))
            bar.update(len(run))
    return out
