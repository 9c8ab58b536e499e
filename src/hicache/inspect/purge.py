"""``hicache inspect purge``: remove pages by namespace, by age, or all of them; a dry run by default."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from ..config import format_size
from ..errors import ConfigError
from ..tiers.storage.base import StorageBackend, StoredPage
from ..tiers.storage.page_format import PageCodec, parse_header, writer_codec
from .walk import batches, list_all, progress

__all__ = ["PurgeReport", "purge"]


@dataclass
class PurgeReport:
    tier: str
    kind: str
    pages: int  # listed
    selected: int
    selected_bytes: int
    removed: int
    dry_run: bool
    #: Entries listed under a page's name that are not pages (a FIFO, a link: no size, no age). An
    #: age cannot select them: they are left to ``verify --repair``, which removes them.
    not_pages: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        what = f"{self.selected} of {self.pages} pages ({format_size(self.selected_bytes)})"
        if self.dry_run:
            line = f"storage tier {self.tier} ({self.kind}): would remove {what}; run again with --yes to remove them"
        else:
            line = f"storage tier {self.tier} ({self.kind}): removed {what}"
        if self.not_pages:
            line += (f"\nskipped {self.not_pages} entries that are not pages (not regular files: no age); "
                     "`verify --repair` removes them")
        return line


async def purge(
    backend: StorageBackend,
    codec: PageCodec | tuple[PageCodec, ...],
    tier: str,
    *,
    namespace: str | None = None,
    older_than_s: float | None = None,
    everything: bool = False,
    dry_run: bool = True,
    quiet: bool = False,
    now: float | None = None,
) -> PurgeReport:
    """Select pages (all of them, or those of a namespace and/or unused for ``older_than_s``) and,
    unless ``dry_run``, remove them.

    ``namespace``: a hex prefix of the header's namespace field (as ``summary`` shows it), or
    ``this`` for the config's own namespace, or ``other`` for every other one.
    """
    if everything == (namespace is not None or older_than_s is not None):
        raise ConfigError("say what to purge: --all, or --namespace and/or --older-than (not --all with them)")
    if namespace is not None and namespace not in ("this", "other"):
        if len(namespace) < 4 or any(c not in "0123456789abcdef" for c in namespace.lower()):
            raise ConfigError(f"--namespace takes 'this', 'other' or a hex prefix of 4+ digits, got {namespace!r}")
    now = time.time() if now is None else now
    pages = await list_all(backend, quiet=quiet)
    listed = len(pages)
    not_pages = 0
    if older_than_s is not None:
        # An entry with no size is not a page (the file tier lists a FIFO or a link so): it has no
        # age either, and must not make the backend look as if it kept none.
        not_pages = sum(p.size is None for p in pages)
        pages = [p for p in pages if p.size is not None]
        if any(p.last_used is None for p in pages):
            raise ConfigError(
                f"the {backend.kind} backend keeps no last-use time for its pages: --older-than cannot be used here"
            )
        pages = [p for p in pages if now - (p.last_used or now) > older_than_s]
    if namespace is not None:
        pages = await _of_namespace(backend, codec, pages, namespace, quiet)
    report = PurgeReport(
        tier=tier, kind=backend.kind, pages=listed, selected=len(pages),
        selected_bytes=sum(p.size or 0 for p in pages), removed=0, dry_run=dry_run, not_pages=not_pages,
    )
    if not dry_run:
        with progress(len(pages), "removing", quiet) as bar:
            for run in batches(pages, max_pages=backend.max_batch):
                await backend.delete([p.key for p in run])
                report.removed += len(run)
                bar.update(len(run))
    return report


async def _of_namespace(
    backend: StorageBackend, codec: PageCodec | tuple[PageCodec, ...], pages: list[StoredPage], namespace: str,
    quiet: bool,
) -> list[StoredPage]:
    out = []
    with progress(len(pages), "reading headers", quiet) as bar:
        for run in batches(pages, max_bytes=64 * 1024**2):
            for page, raw in zip(run, await backend.read_headers(run), strict=True):
                info = parse_header(raw) if raw is not None else None
                if info is None:
                    continue  # not a hicache page: `verify --repair` removes those
                ns = info.namespace.hex()
                mine = writer_codec(codec, info) is not None
                if (namespace == "this" and mine) or (namespace == "other" and not mine) or ns.startswith(namespace.lower()):
                    out.append(page)
            bar.update(len(run))
    return out
