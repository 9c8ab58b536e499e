"""``hicache inspect summary|verify|purge CONFIG``: the command line over ``hicache.inspect``."""

from __future__ import annotations

import argparse
import json
import sys

import anyio

from ..errors import HiCacheError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache inspect",
        description="Look into a storage tier described by a hicache config (file, redis, mooncake, s3, "
        "or a plugin that can list its pages).",
    )
    sub = parser.add_subparsers(dest="verb", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="a hicache YAML config whose tiers.storage names the tier")
        p.add_argument("--tier", default=None, help="the storage tier's name (needed when the config has several)")
        p.add_argument("--json", action="store_true", help="print JSON for machines instead of a table")
        p.add_argument("--quiet", action="store_true", help="no progress bars")

    common(sub.add_parser("summary", help="pages, bytes, namespaces, codecs, bytes saved, ages, capacity used"))
    common(sub.add_parser("pages", help="every page: its codec chain, stored bytes and bytes saved"))
    verify = sub.add_parser("verify", help="read every page and check header and checksum (or MAC)")
    common(verify)
    verify.add_argument("--repair", action="store_true", help="remove the corrupt pages found")
    verify.add_argument(
        "--max-page-bytes", type=int, default=None,
        help="read objects up to this size (default: the largest page the config's model can store; "
        "larger ones are reported as oversized, not read)",
    )
    purge = sub.add_parser("purge", help="remove pages (a dry run unless --yes)")
    common(purge)
    purge.add_argument("--namespace", help="'this' (the config's), 'other', or a namespace hex prefix from summary")
    purge.add_argument("--older-than", help="pages not used for this long, e.g. 7d, 12h, 30m")
    purge.add_argument("--all", action="store_true", help="every page of the tier")
    purge.add_argument("--yes", action="store_true", help="really remove them (default: report what would go)")
    return parser


async def _run(args: argparse.Namespace) -> object:
    from ..containers import inspection_target, load_config
    from .pages import list_page_lines
    from .purge import purge
    from .summary import summarize
    from .verify import verify
    from .walk import parse_duration

    config = load_config(args.config)
    entry, backend, codec = inspection_target(config, args.tier)
    older = parse_duration(args.older_than) if getattr(args, "older_than", None) else None
    async with backend:
        if args.verb == "summary":
            return await summarize(backend, codec, config, entry.tier_name, quiet=args.quiet)
        if args.verb == "pages":
            return await list_page_lines(backend, codec, entry.tier_name, quiet=args.quiet)
        if args.verb == "verify":
            return await verify(
                backend, codec, entry.tier_name, repair=args.repair, quiet=args.quiet,
                max_page_bytes=args.max_page_bytes,
            )
        return await purge(
            backend, codec, entry.tier_name, namespace=args.namespace, older_than_s=older,
            everything=args.all, dry_run=not args.yes, quiet=args.quiet,
        )


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (verify: nothing corrupt left), 1 verify found corrupt pages it did not
    remove, 2 a bad config or argument, or a backend that cannot list or failed."""
    args = _parser().parse_args(argv)
    try:
        report = anyio.run(_run, args)
    except HiCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))  # type: ignore[attr-defined]
    else:
        print(report.table())  # type: ignore[attr-defined]
    corrupt = getattr(report, "corrupt", None)
    return 1 if corrupt and not getattr(report, "repair", False) else 0
