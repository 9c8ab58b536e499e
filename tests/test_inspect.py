"""``hicache inspect summary|verify|purge`` on every built-in storage kind, against the real servers.

Pages are written by real caches (this config's and another model's), one is corrupted through the
backend itself, and the CLI must count, find, repair and purge exactly what it should.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from hicache import HiCache, load_config
from hicache.cli import main as cli_main
from hicache.errors import ConfigError
from hicache.keys import as_token_bytes, chain_keys
from hicache.tiers.storage.base import PageIO, StoredPage
from hicache.tiers.storage.page_format import HEADER_BYTES
from hicache.tiers.storage.registry import resolve_backend

from .test_attach_detach import GEOMETRY, PAGE, PROMPT_PAGES, config, kv_of, tokens_of

KINDS = ["file", "redis", "redis-cluster", "mooncake", "s3", "nixl"]
OURS, FOREIGN = 5, 2  # prompts written by this config and by another model


@pytest.fixture(params=KINDS)
def entry(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    prefix = f"i{uuid.uuid4().hex[:10]}"
    kind = request.param
    if kind == "file":
        return {"kind": "file", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"}
    if kind == "nixl":
        from hicache.tiers.storage.nixl.agent import nixl_available

        from .servers import unavailable

        if (why := nixl_available()) is not None:
            unavailable(why)
        return {"kind": "nixl", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"}
    if kind == "redis":
        server = request.getfixturevalue("valkey")
        return {"kind": "redis", "name": "store", "url": f"redis://127.0.0.1:{server.port}/0", "key_prefix": prefix}
    if kind == "redis-cluster":
        cluster = request.getfixturevalue("valkey_cluster")
        return {"kind": "redis", "name": "store", "cluster": True, "url": cluster.url, "key_prefix": prefix,
                "cluster_seeds": [f"127.0.0.1:{p}" for p in cluster.ports[1:]]}
    if kind == "mooncake":
        settings = request.getfixturevalue("mooncake_holder")
        return {"kind": "mooncake", "name": "store", **settings, "key_prefix": prefix, "global_segment_size": 0}
    s3 = request.getfixturevalue("seaweedfs")
    return {"kind": "s3", "name": "store", **s3.settings(key_prefix=prefix)}


def write_config(path: Path, entry: dict[str, Any], **top: Any) -> str:
    """A YAML config file (JSON is YAML) holding the model and the one storage tier."""
    path.write_text(json.dumps({"model": GEOMETRY, "page_size": PAGE, "tiers": {"storage": [entry]}, **top}))
    return str(path)


def fill(entry: dict[str, Any], first: int, count: int, **top: Any) -> list[bytes]:
    """Store ``count`` prompts through a real write-through cache; the page keys written."""

    async def run() -> list[bytes]:
        cfg = config([entry])
        if top:
            cfg = load_config(overrides=cfg.model_dump(mode="python") | {"tiers": {"storage": [entry]}} | top, env={})
        async with HiCache.from_config(cfg) as cache:
            for i in range(first, first + count):
                await cache.store(tokens_of(i), kv_of(i))
            seed = cache.controller.tree.seed
            codec = cache.controller.storage[0].codec
        keys = [k for i in range(first, first + count) for k in chain_keys(seed, as_token_bytes(tokens_of(i)), PAGE)]
        return codec.storage_keys(keys)

    return anyio.run(run)


def tamper(entry: dict[str, Any], name: bytes, *, rename_to: bytes | None = None) -> None:
    """Through the backend itself: flip one payload byte of page ``name`` (or copy it, intact, to another name)."""

    async def run() -> None:
        cls = resolve_backend(entry["kind"])
        options = cls.inspection_options({k: v for k, v in entry.items() if k not in ("kind", "name")})
        async with cls(**options) as backend:
            size = HEADER_BYTES + 2 * 3 * PAGE * 2 * 16 * 4
            (blob,) = await backend.read_stored([StoredPage(name, size, None)])
            assert blob is not None
            data = bytearray(blob)
            if rename_to is None:
                data[HEADER_BYTES + 100] ^= 0x40
            target = rename_to or name
            assert await backend.set([target], [PageIO.of(data[:HEADER_BYTES], data[HEADER_BYTES:])]) == 1

    anyio.run(run)


async def listed_names(entry: dict[str, Any]) -> set[bytes]:
    cls = resolve_backend(entry["kind"])
    async with cls(**cls.inspection_options({k: v for k, v in entry.items() if k not in ("kind", "name")})) as backend:
        return {p.key async for batch in backend.list_pages() for p in batch}


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = cli_main(["inspect", *args, "--quiet"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in args and out else out + err)


def test_the_three_verbs_on_every_storage_kind(entry: dict[str, Any], tmp_path: Path) -> None:
    """summary, verify (--repair) and purge through the library, one reader client for all of them."""
    from hicache.containers import inspection_target
    from hicache.inspect import purge, summarize, verify

    ours = fill(entry, 0, OURS)
    foreign = fill(entry, 100, FOREIGN, model=GEOMETRY | {"name": "another-model"})
    cfg = load_config(write_config(tmp_path / "config.yaml", entry))
    total = (OURS + FOREIGN) * PROMPT_PAGES
    tamper(entry, ours[7])

    async def run() -> None:
        tier, backend, codec = inspection_target(cfg)
        async with backend:
            summary = await summarize(backend, codec, cfg, "store", quiet=True)
            assert summary.pages == total and summary.kind == entry["kind"]
            groups = {g.label.split(" (")[0]: g for g in summary.groups}
            assert groups["this config"].pages == OURS * PROMPT_PAGES and "attach-model" in groups["this config"].label
            assert groups["another model, revision, geometry or tenant_salt"].pages == FOREIGN * PROMPT_PAGES
            assert groups["this config"].shape == "2x3x16x2x16 float32"
            assert summary.ages_known == (entry["kind"] != "mooncake")

            report = await verify(backend, codec, "store", quiet=True)
            assert report.ok == total - 1 and report.ours == OURS * PROMPT_PAGES - 1
            assert [(c.name, c.reason) for c in report.corrupt] == [(ours[7].hex(), "checksum")]
            assert (await verify(backend, codec, "store", repair=True, quiet=True)).removed == 1
            report = await verify(backend, codec, "store", quiet=True)
            assert report.pages == total - 1 and not report.corrupt

            dry = await purge(backend, codec, "store", namespace="other", quiet=True)
            assert dry.dry_run and dry.selected == FOREIGN * PROMPT_PAGES and dry.removed == 0
            done = await purge(backend, codec, "store", namespace="other", dry_run=False, quiet=True)
            assert done.removed == FOREIGN * PROMPT_PAGES
            names = {p.key async for batch in backend.list_pages() for p in batch}
            assert names.isdisjoint(foreign) and len(names) == total - 1 - FOREIGN * PROMPT_PAGES
            if entry["kind"] == "mooncake":
                with pytest.raises(ConfigError, match="keeps no last-use time"):
                    await purge(backend, codec, "store", older_than_s=3600, quiet=True)
            else:
                assert (await purge(backend, codec, "store", older_than_s=3600, quiet=True)).selected == 0
                # the future: everything is older than -1 s
                assert (await purge(backend, codec, "store", older_than_s=-1, quiet=True)).selected == len(names)
            gone = await purge(backend, codec, "store", everything=True, dry_run=False, quiet=True)
            assert gone.removed == len(names)
            assert (await summarize(backend, codec, cfg, "store", quiet=True)).pages == 0

    anyio.run(run)


def test_the_cli_prints_tables_and_json_with_exit_codes(tmp_path: Path, capsys) -> None:
    entry = {"kind": "file", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"}
    ours = fill(entry, 0, 2)
    cfg = write_config(tmp_path / "config.yaml", entry)
    code, table = inspect(capsys, "summary", cfg)
    assert code == 0 and "12 pages" in table and "this config (attach-model)" in table
    tamper(entry, ours[3])
    code, table = inspect(capsys, "verify", cfg)
    assert code == 1 and "1 corrupt" in table and ours[3].hex() in table and "--repair" in table
    code, report = inspect(capsys, "verify", cfg, "--repair", "--json")
    assert code == 0 and report["removed"] == 1
    code, table = inspect(capsys, "purge", cfg, "--older-than", "1d")
    assert code == 0 and "would remove 0 of 11 pages" in table
    code, out = inspect(capsys, "purge", cfg, "--older-than", "soon")
    assert code == 2 and "invalid duration" in out
    code, out = inspect(capsys, "purge", cfg, "--all", "--namespace", "this")
    assert code == 2 and "not --all with them" in out
    code, table = inspect(capsys, "purge", cfg, "--namespace", "this", "--yes")
    assert code == 0 and "removed 11 of 11 pages" in table


def test_verify_with_a_tenant_key_checks_macs_and_leaves_other_tenants_alone(tmp_path: Path, capsys) -> None:
    entry = {"kind": "file", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"}
    key = "a-tenant-key-for-the-tests-0123456789"
    names = fill(entry, 0, 3, tenant_key=key)
    keyed = write_config(tmp_path / "keyed.yaml", entry, tenant_key=key)
    unkeyed = write_config(tmp_path / "plain.yaml", entry)
    other = write_config(tmp_path / "other.yaml", entry, tenant_key="another-tenant-key-000000000000")

    code, report = inspect(capsys, "verify", keyed, "--json")
    assert code == 0 and report["ok"] == report["ours"] == 3 * PROMPT_PAGES
    tamper(entry, names[2])  # a flipped bit: the MAC catches it
    tamper(entry, names[0], rename_to=names[1])  # a valid page replayed under another name
    code, report = inspect(capsys, "verify", keyed, "--json")
    assert code == 1 and sorted((c["name"], c["reason"]) for c in report["corrupt"]) == sorted(
        [(names[2].hex(), "mac"), (names[1].hex(), "stored under another name")])
    # Without the key (or with another tenant's), keyed pages can be neither proven good nor bad.
    # The replayed page is caught by anyone (its header names another storage name); the flipped bit is not.
    code, report = inspect(capsys, "verify", unkeyed, "--repair", "--json")
    assert report["ok"] == 0 and report["unverifiable"] == 3 * PROMPT_PAGES - 1
    assert [c["reason"] for c in report["corrupt"]] == ["stored under another name"] and report["removed"] == 1
    code, report = inspect(capsys, "verify", other, "--repair", "--json")
    assert code == 0 and report["ok"] == 0 and report["unverifiable"] == 3 * PROMPT_PAGES - 1 and report["removed"] == 0
    code, report = inspect(capsys, "verify", keyed, "--repair", "--json")
    assert [c["reason"] for c in report["corrupt"]] == ["mac"] and report["removed"] == 1
    code, summary = inspect(capsys, "summary", unkeyed, "--json")
    assert [g["label"] for g in summary["groups"]] == ["keyed: another tenant key or model"]


def test_a_backend_that_cannot_list_says_so(tmp_path: Path, capsys, mooncake_cluster) -> None:
    failing = write_config(tmp_path / "f.yaml", {"kind": "tests.fakes:FailingStorageBackend"})
    code, out = inspect(capsys, "summary", failing)
    assert code == 2 and "list failed" in out and "no listing operation" in out
    mooncake = {"kind": "mooncake", **{k: v for k, v in mooncake_cluster.items() if k != "admin_url"}}
    code, out = inspect(capsys, "verify", write_config(tmp_path / "m.yaml", mooncake))
    assert code == 2 and "admin_url" in out
    code, out = inspect(capsys, "purge", failing)
    assert code == 2 and "--all" in out


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*.kv") if p.is_file() and not p.is_symlink())


def test_verify_reads_as_a_reader_and_leaves_recency_alone(tmp_path: Path, capsys) -> None:
    """verify read every page through the cache's read path, which refreshes each file's mtime: after
    it, summary showed every page as just used and ``purge --older-than`` selected nothing."""
    import os
    import time

    entry = {"kind": "file", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"}
    fill(entry, 0, 2)
    cfg = write_config(tmp_path / "config.yaml", entry)
    week_ago = time.time() - 8 * 86400
    files = page_files(tmp_path / "pages")
    for path in files:
        os.utime(path, (week_ago, week_ago))
    code, report = inspect(capsys, "verify", cfg, "--json")
    assert code == 0 and report["ok"] == len(files) == 2 * PROMPT_PAGES
    assert [p.stat().st_mtime for p in files] == [week_ago] * len(files)
    code, summary = inspect(capsys, "summary", cfg, "--json")
    assert summary["newest_use"] == pytest.approx(week_ago)
    code, table = inspect(capsys, "purge", cfg, "--older-than", "7d")
    assert code == 0 and f"would remove {len(files)} of {len(files)} pages" in table


def test_purge_by_age_skips_entries_that_are_not_pages(tmp_path: Path, capsys) -> None:
    """One FIFO or link named like a page made ``purge --older-than`` refuse with "the file backend
    keeps no last-use time"; they are reported and left to ``verify --repair``, the pages purged."""
    import os
    import time

    entry = {"kind": "file", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"}
    names = fill(entry, 0, 2)
    cfg = write_config(tmp_path / "config.yaml", entry)
    old = time.time() - 8 * 86400
    files = page_files(tmp_path / "pages")
    for path in files[:5]:
        os.utime(path, (old, old))
    fifo, link = (tmp_path / "pages" / n[:2] / f"{n}.kv" for n in ("ab" + "0" * 30, "cd" + "1" * 30))
    for planted in (fifo, link):
        planted.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    link.symlink_to(files[6])
    code, table = inspect(capsys, "purge", cfg, "--older-than", "7d")
    assert code == 0, table
    assert f"would remove 5 of {len(names) + 2} pages" in table and "2 entries that are not pages" in table
    code, report = inspect(capsys, "purge", cfg, "--older-than", "7d", "--yes", "--json")
    assert code == 0 and report["removed"] == 5 and report["not_pages"] == 2
    assert len(page_files(tmp_path / "pages")) == len(names) - 5
    assert fifo.exists() and link.is_symlink()  # left alone: verify --repair removes them
    code, report = inspect(capsys, "verify", cfg, "--repair", "--json")
    assert report["removed"] == 2 and not fifo.exists() and not link.is_symlink() and files[6].is_file()


def test_verify_skips_objects_larger_than_any_page_without_reading_them(tmp_path: Path, capsys) -> None:
    """A 4 GiB file (sparse: no disk taken) named like a page in a file tier's folder: verify read every
    listed object whole, whatever its size (4 GiB of memory, then 4 GiB read). Now an object larger
    than the largest page the config's model can store is reported as oversized and never read."""
    import os
    import resource
    import time

    from hicache.inspect.verify import largest_page_bytes

    entry = {"kind": "file", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"}
    fill(entry, 0, 1)
    cfg = write_config(tmp_path / "config.yaml", entry)
    huge_name = "ee" + "5" * 30
    huge = tmp_path / "pages" / "ee" / f"{huge_name}.kv"
    huge.parent.mkdir(exist_ok=True)
    huge.touch()
    os.truncate(huge, 4 * 2**30)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    start = time.monotonic()
    code, report = inspect(capsys, "verify", cfg, "--json")
    assert time.monotonic() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 512 * 1024  # never 4 GiB
    assert code == 0 and report["ok"] == PROMPT_PAGES and report["corrupt"] == []
    assert report["oversized"] == [{"name": huge_name, "reason": "oversized", "bytes": 4 * 2**30}]
    limit = report["max_page_bytes"]
    from hicache.containers import inspection_target

    _, _, codec = inspection_target(load_config(cfg), None)
    assert limit == largest_page_bytes(codec) >= HEADER_BYTES + 2 * 3 * PAGE * 2 * 16 * 4  # an exact page fits
    code, table = inspect(capsys, "verify", cfg, "--repair")
    assert code == 0 and "oversized: 1 objects larger than" in table and huge_name in table
    assert huge.stat().st_size == 4 * 2**30  # not removed: it may be a larger model's page
    huge.unlink()
    # An object just over the bound is read when asked (--max-page-bytes): it is not a page, corrupt.
    over = tmp_path / "pages" / "ee" / f"{huge_name}.kv"
    over.write_bytes(b"x" * (limit + 1))
    code, report = inspect(capsys, "verify", cfg, "--json")
    assert [p["name"] for p in report["oversized"]] == [huge_name] and report["corrupt"] == []
    code, report = inspect(capsys, "verify", cfg, "--json", "--max-page-bytes", str(limit + 1))
    assert code == 1 and report["oversized"] == []
    assert [c["reason"] for c in report["corrupt"]] == ["not a hicache page"]
