"""Walking a storage tier: listing it whole (with a progress bar), batches of pages, durations."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from ..errors import ConfigError
from ..tiers.storage.base import StorageBackend, StoredPage

__all__ = ["batches", "list_all", "parse_duration", "progress"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"2w"`` (or a sum: ``"1d12h"``) in seconds."""
    parts = re.fullmatch(r"(?:\d+(?:\.\d+)?[smhdw])+", text.strip())
    if not parts:
        raise ConfigError(f"invalid duration {text!r} (expected e.g. 7d, 12h, 30m, 45s or 1d12h)")
    return sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhdw])", text))


def progress(total: int | None, what: str, quiet: bool) -> tqdm:
    return tqdm(total=total, unit="page", desc=what, disable=quiet, leave=False, dynamic_ncols=True)


async def list_all(backend: StorageBackend, *, quiet: bool = False) -> list[StoredPage]:
    """Every page the backend lists (deduplicated by name: a listing may repeat one)."""
    seen: dict[bytes, StoredPage] = {}
    with progress(None, "listing", quiet) as bar:
        async for batch in backend.list_pages():
            for page in batch:
                seen[page.key] = page
            bar.update(len(batch))
    return list(seen.values())


def batches(pages: Sequence[StoredPage], max_bytes: int = 256 * 1024**2, max_pages: int = 256) -> Iterator[Sequence[StoredPage]]:
    """Consecutive runs of pages holding at most ``max_bytes`` (at least one page each)."""
    start, size = 0, 0
    for i, page in enumerate(pages):
        size += page.size or 0
        if i > start and (size > max_bytes or i - start >= max_pages):
            yield pages[start:i]
            start, size = i, page.size or 0
    if start < len(pages):
        yield pages[start:]
