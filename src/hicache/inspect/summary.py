"""``hicache inspect summary``: what a storage tier holds, grouped by namespace, format and geometry."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import HiCacheConfig, format_size
from ..tiers.storage.base import StorageBackend
from ..tiers.storage.page_format import (
    KEYED_CODEC_FORMAT_VERSION,
    KEYED_FORMAT_VERSION,
    OLD_KEYED_FORMAT_VERSIONS,
    PageCodec,
    parse_header,
    writer_codec,
)
from .walk import batches, list_all, progress

__all__ = ["Group", "Summary", "summarize"]


@dataclass
class Group:
    """Pages sharing one namespace field, format and geometry."""

    namespace: str  # hex of the header's namespace field; "" for pages whose header is unreadable
    label: str  # "this config (model ...)", "another namespace", "not a hicache page"
    version: int | None
    shape: str
    codecs: str = "-"  # the codec chain the pages were written through ("-": none)
    pages: int = 0
    bytes: int = 0
    saved_bytes: int = 0  # logical KV bytes minus stored bytes (what the codecs kept off the store)
    oldest_use: float | None = None  # Unix time of the least recent use among them
    newest_use: float | None = None


@dataclass
class Summary:
    tier: str
    kind: str
    pages: int
    bytes: int
    capacity_bytes: int | None
    oldest_use: float | None
    newest_use: float | None
    groups: list[Group] = field(default_factory=list)
    ages_known: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def table(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        lines = [
            f"storage tier {self.tier} ({self.kind}): {self.pages} pages, {format_size(self.bytes)}",
        ]
        if self.capacity_bytes:
            lines.append(f"capacity: {format_size(self.capacity_bytes)}, {100 * self.bytes / self.capacity_bytes:.1f}% used")
        if self.ages_known and self.oldest_use is not None and self.newest_use is not None:
            lines.append(f"last used: oldest {_ago(now - self.oldest_use)} ago, newest {_ago(now - self.newest_use)} ago")
        elif not self.ages_known:
            lines.append("last used: not kept by this backend")
        header = (f"{'namespace':<14} {'format':>6}  {'geometry':<24} {'codec':<22} {'pages':>8} {'bytes':>10} "
                  f"{'saved':>10}  {'oldest use':>10}  what")
        lines += ["", header, "-" * len(header)]
        for g in sorted(self.groups, key=lambda g: -g.pages):
            oldest = _ago(now - g.oldest_use) if g.oldest_use is not None else "-"
            saved = format_size(g.saved_bytes) if g.saved_bytes >= 0 else "-" + format_size(-g.saved_bytes)
            lines.append(
                f"{(g.namespace[:12] or '-'):<14} {g.version if g.version is not None else '-':>6}  {g.shape:<24} "
                f"{g.codecs:<22} {g.pages:>8} {format_size(g.bytes):>10} {saved:>10}  {oldest:>10}  {g.label}"
            )
        return "\n".join(lines)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


async def summarize(
    backend: StorageBackend, codec: PageCodec | tuple[PageCodec, ...], config: HiCacheConfig, tier: str, *,
    quiet: bool = False,
) -> Summary:
    """List the tier and read every page's header (only the header where the backend can)."""
    pages = await list_all(backend, quiet=quiet)
    groups: dict[tuple[str, int | None, str], Group] = {}
    model = config.model.name + (f" rev {config.model.revision}" if config.model.revision else "")
    with progress(len(pages), "reading headers", quiet) as bar:
        for run in batches(pages, max_bytes=64 * 1024**2):
            for page, raw in zip(run, await backend.read_headers(run), strict=True):
                info = parse_header(raw) if raw is not None else None
                if info is None:
                    key = ("", None, "-", "-")
                    label = "not a hicache page (or unreadable)"
                else:
                    key = (info.namespace.hex(), info.version, info.shape, ",".join(info.codecs) or "-")
                    mine = writer_codec(codec, info)
                    if mine is not None:
                        part = mine.part.removeprefix("layers:")
                        if part == "state":
                            part = "checkpoint (recurrent state)"
                        label = f"this config ({model})" + (f", {part} layers" if part else "")
                    elif info.version == KEYED_FORMAT_VERSION:
                        label = "keyed: another tenant key or model"
                    elif info.version == KEYED_CODEC_FORMAT_VERSION:
                        label = "keyed: another tenant key, model or codec chain"
                    elif info.version in OLD_KEYED_FORMAT_VERSIONS:
                        label = "keyed by an earlier format (BLAKE3 MAC): never read"
                    elif info.codecs:
                        label = "another codec chain, model, geometry or tenant_salt"
                    else:
                        label = "another model, revision, geometry or tenant_salt"
                g = groups.get(key)
                if g is None:
                    g = groups[key] = Group(namespace=key[0], label=label, version=key[1], shape=key[2], codecs=key[3])
                g.pages += 1
                g.bytes += page.size or 0
                if info is not None and info.logical_bytes is not None:
                    g.saved_bytes += info.logical_bytes - info.payload_bytes
                if page.last_used is not None:
                    g.oldest_use = page.last_used if g.oldest_use is None else min(g.oldest_use, page.last_used)
                    g.newest_use = page.last_used if g.newest_use is None else max(g.newest_use, page.last_used)
            bar.update(len(run))
    uses = [p.last_used for p in pages if p.last_used is not None]
    capacity = backend.settings.model_dump().get("capacity")
    return Summary(
        tier=tier,
        kind=backend.kind,
        pages=len(pages),
        bytes=sum(p.size or 0 for p in pages),
        capacity_bytes=capacity if isinstance(capacity, int) else None,
        oldest_use=min(uses) if uses else None,
        newest_use=max(uses) if uses else None,
        groups=list(groups.values()),
        ages_known=bool(uses) or not pages,
    )
