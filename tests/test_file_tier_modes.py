"""Who may read the file tier's pages (issue 50, item 8): folders 0700 and page files 0600 by default,
whatever the umask; ``share: group`` for a folder shared on purpose (folders 2770, files 0660).

Pages were written 0644 in 0755 folders: every local user could read every page (with a tenant key
the payload is authenticated, not encrypted: the KV, and so the prompt, in the clear). Each test
writes real page files under the usual umask (022) and reads the modes back; one reads as another
user (``nobody``) to show what the modes mean.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from hicache.errors import ConfigError
from hicache.tiers.storage import HEADER_BYTES, PageIO
from hicache.tiers.storage import page_files as page_files_module
from hicache.tiers.storage.file import FileBackend

PAYLOAD = 4096


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The umask most systems run with: it leaves group and others read bits on what is created."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def pages(n: int, seed: int = 0) -> list[PageIO]:
    rng = np.random.default_rng(seed)
    return [PageIO.of(rng.integers(0, 256, HEADER_BYTES, dtype=np.uint8), rng.integers(0, 256, PAYLOAD, dtype=np.uint8))
            for _ in range(n)]


KEYS = [bytes([0x11 * (i + 1)]) * 16 for i in range(4)]  # each in its own shard


def modes(root: Path) -> dict[str, set[int]]:
    """The permission bits (with setgid) of the root, the shard folders and the page files."""
    shards = [p for p in root.iterdir() if p.is_dir()]
    files = [f for s in shards for f in s.iterdir()]
    assert len(shards) == len(files) == len(KEYS)
    bits = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    return {"root": {bits(root)}, "shards": {bits(s) for s in shards}, "files": {bits(f) for f in files}}


async def write(root: Path, kind: type[FileBackend] = FileBackend, **settings: object) -> None:
    async with kind(path=str(root), fsync="never", **settings) as backend:
        assert await backend.set(KEYS, pages(len(KEYS))) == len(KEYS)
        assert await backend.set(KEYS[:2], pages(2, seed=1)) == 2  # rewritten: through a temporary name


@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "temporary-name"])
async def test_pages_and_folders_are_the_owners_alone_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unnamed: bool
) -> None:
    if not unnamed:  # a file system without O_TMPFILE: every page goes through a temporary file renamed
        monkeypatch.setattr(page_files_module, "_anonymous", [False])
    root = tmp_path / "made" / "pages"  # the tier makes its folder
    await write(root)
    assert modes(root) == {"root": {0o700}, "shards": {0o700}, "files": {0o600}}


async def test_share_group_lets_the_folders_group_in_whatever_the_umask(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    await write(root, share="group")
    # setgid folders: what is made in them takes the folder's group, not each writer's own
    assert modes(root) == {"root": {0o2770}, "shards": {0o2770}, "files": {0o660}}


@pytest.mark.parametrize("share", ["private", "group"])
async def test_kind_nixl_shares_the_layout_and_its_modes(tmp_path: Path, share: str) -> None:
    """``kind: nixl`` writes through NIXL's POSIX plugin into files the file tier's code opens."""
    from hicache.tiers.storage.nixl.agent import nixl_available

    from .servers import unavailable

    if (why := nixl_available()) is not None:
        unavailable(why)
    from hicache.tiers.storage.nixl.posix import NixlFileBackend

    root = tmp_path / "pages"
    await write(root, NixlFileBackend, share=share)
    folder, file = (0o700, 0o600) if share == "private" else (0o2770, 0o660)
    assert modes(root) == {"root": {folder}, "shards": {folder}, "files": {file}}


def test_share_takes_only_the_two_documented_values() -> None:
    assert FileBackend(path="/tmp/x", share="group").settings.share == "group"
    assert FileBackend(path="/tmp/x").settings.share == "private"
    with pytest.raises(ConfigError, match="share"):
        FileBackend(path="/tmp/x", share="world")


async def test_an_existing_folder_open_to_others_is_left_alone_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "pages"
    root.mkdir(mode=0o755)
    caplog.set_level(logging.WARNING, logger="hicache.tiers.storage.file")
    await write(root)
    assert modes(root) == {"root": {0o755}, "shards": {0o700}, "files": {0o600}}  # the folder is the user's
    assert "mode is 755" in caplog.text and "chmod 700" in caplog.text


def _read_as_nobody(root: str, names: list[str]) -> dict:
    """In a forked child that dropped root: can it list the shard folders, and read each page file?"""
    read, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = {}
            for name in names:
                try:
                    with open(os.path.join(root, name), "rb") as f:
                        f.read(1)
                    out[name] = "read"
                except OSError as exc:
                    out[name] = exc.strerror or "error"
            os.write(write_end, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root to switch users")
def test_another_user_cannot_read_a_page_even_in_a_folder_open_to_all() -> None:
    """The folder is 0755 (made so by its owner), so only the page files' own modes stand in the way."""
    top = Path(tempfile.mkdtemp(prefix="hicache-modes-"))  # outside pytest's root-only folder
    try:
        os.chmod(top, 0o755)
        root = top / "pages"
        root.mkdir(mode=0o755)
        anyio.run(write, root)
        for shard in root.iterdir():
            shard.chmod(0o755)  # even a shard opened to all: the page files are the owner's
        names = [str(f.relative_to(root)) for f in root.glob("??/*.kv")]
        assert len(names) == len(KEYS)
        got = _read_as_nobody(str(root), names)
        assert set(got.values()) == {"Permission denied"}, got
    finally:
        shutil.rmtree(top, ignore_errors=True)
