"""The file tier in a folder others can write to (issue 11, points 2-4).

Real FIFOs, symbolic links, sockets and unreadable files are planted where page files or shard
folders belong. None may hang a read (a FIFO's ``open`` would wait for a writer in a thread that no
timeout reaches), leak a descriptor, be followed out of the tier's folder, or stop the pages before
it from being served; each is a counted corrupt page, removed when that is safe.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest

from hicache import HiCache
from hicache.tiers.storage import HEADER_BYTES, PageIO
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.page_files import read_pages

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, push_to_storage
from .hostile import open_fds, read_back, storage_names

PAGES = 4


def file_config(root: Path):
    return make_config(
        8, 16, tiers={"storage": [{"kind": "file", "path": str(root), "fsync": "never"}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )


def page_path(root: Path, name: bytes) -> Path:
    return root / name.hex()[:2] / (name.hex() + ".kv")


@contextmanager
def fifo_watchdog(fifo: Path, after_s: float) -> Iterator[list[bool]]:
    """If a reader is still blocked opening ``fifo`` after ``after_s``, unblock it (and record that).

    Without this, a test of the old behaviour would hang forever instead of failing.
    """
    fired: list[bool] = []
    done = threading.Event()

    def watch() -> None:
        if done.wait(after_s):
            return
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only if someone waits to read
        except OSError:
            return
        fired.append(True)
        os.close(fd)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield fired
    finally:
        done.set()
        thread.join()


async def stored_prompt(root: Path, seed: int = 1):
    config = file_config(root)
    tokens, kv = make_tokens(PAGES * 4, seed=seed), make_kv(config, PAGES * 4, seed=seed)
    return config, tokens, kv, [page_path(root, n) for n in storage_names(config, tokens)]


async def test_a_fifo_in_place_of_a_page_is_a_corrupt_miss_never_a_hang(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    config, tokens, kv, files = await stored_prompt(root)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await push_to_storage(cache)
        files[2].unlink()
        os.mkfifo(files[2])
        with fifo_watchdog(files[2], after_s=8.0) as fired:
            start = time.monotonic()
            with anyio.fail_after(30):
                assert await read_back(cache, tokens, kv) == 2 * 4  # the pages before it
            assert not fired, "the read waited on the FIFO until the watchdog opened its other end"
            assert time.monotonic() - start < 5
        assert cache.stats().storage["file"].backend.corrupt_pages == 1
        assert not files[2].exists()  # removed: the next lookup does not meet it again
        await push_to_storage(cache)
        with anyio.fail_after(30):
            assert await read_back(cache, tokens, kv) == 2 * 4
        assert_consistent(cache)


async def test_a_socket_or_a_folder_in_place_of_a_page_is_a_corrupt_miss(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    config, tokens, kv, files = await stored_prompt(root)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await push_to_storage(cache)
        files[1].unlink()
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(files[1]))
            assert await read_back(cache, tokens, kv) == 4
        assert not files[1].exists()
        await cache.store(tokens, kv)  # written again, in its place
        await push_to_storage(cache)
        assert await read_back(cache, tokens, kv) == PAGES * 4
        await push_to_storage(cache)
        files[3].unlink()
        files[3].mkdir()  # cannot be removed or replaced by a page: a miss every time, never an error
        for _ in range(2):
            assert await read_back(cache, tokens, kv) == 3 * 4
            await cache.store(tokens, kv)
            await push_to_storage(cache)
        stats = cache.stats().storage["file"]
        assert stats.backend.corrupt_pages >= 2 and stats.backend.errors == 0
        assert_consistent(cache)


async def test_a_link_in_place_of_a_page_is_not_followed_and_leaks_no_descriptor(tmp_path: Path) -> None:
    """Page 2 becomes a link: to a file outside the folder holding the genuine page, then a loop (ELOOP)."""
    root = tmp_path / "pages"
    config, tokens, kv, files = await stored_prompt(root)
    outside = tmp_path / "outside.kv"
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await push_to_storage(cache)
        genuine = files[2].read_bytes()
        files[2].unlink()
        outside.write_bytes(genuine)  # the right bytes, but not in the tier's folder: never read
        files[2].symlink_to(outside)
        assert await read_back(cache, tokens, kv) == 2 * 4
        assert not files[2].is_symlink() and outside.read_bytes() == genuine  # the link went, not its target
        before = open_fds()
        for _ in range(5):
            await cache.store(tokens, kv)  # page 2 is written again (and known to be there)...
            await push_to_storage(cache)
            files[2].unlink()
            files[2].symlink_to(files[2].name)  # ...then becomes a link to itself: open fails with ELOOP
            assert await read_back(cache, tokens, kv) == 2 * 4  # the pages before it are still served
            assert not files[2].is_symlink()
        await cache.wait_idle()
        assert open_fds() == before, "descriptors leaked"
        assert cache.stats().storage["file"].backend.corrupt_pages == 6
        assert_consistent(cache)


def _pages(n: int, payload: int, seed: int = 0) -> list[PageIO]:
    rng = np.random.default_rng(seed)
    return [PageIO.of(rng.integers(0, 256, HEADER_BYTES, dtype=np.uint8), rng.integers(0, 256, payload, dtype=np.uint8))
            for _ in range(n)]


def _keys(n: int) -> list[bytes]:
    return [bytes([0x10 * (i + 1)]) * 16 for i in range(n)]  # each in its own shard


def _read_five_times(root: Path, keys: list[bytes], payload: int) -> dict:
    """Read ``keys`` five times with the tier's reader (the worker-thread function); counts and fd growth."""
    places = [FileBackend._place(k) for k in keys]
    before, got = open_fds(), []
    for _ in range(5):
        into = [PageIO.of(np.zeros(HEADER_BYTES, np.uint8), np.zeros(payload, np.uint8)) for _ in keys]
        got.append(read_pages(root, set(), places, into, 64))
    return {"got": got, "leaked": open_fds() - before}


def _as_nobody(fn, *args) -> dict:
    """Run ``fn(*args)`` in a forked child that dropped root (as root, every file is readable)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no imports from here on (the interpreter's folder may be root's alone)
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, json.dumps(fn(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and out, "the unprivileged reader failed"
    return json.loads(out)


def test_an_unreadable_page_ends_the_read_without_leaking_descriptors() -> None:
    """EACCES: the pages before the unreadable one are served, and every descriptor is closed."""
    keys, payload = _keys(PAGES), 4096
    root = Path(tempfile.mkdtemp(prefix="hicache-eacces-"))  # not under pytest's root-only folder
    try:

        async def write() -> None:
            async with FileBackend(path=str(root), fsync="never") as b:
                assert await b.set(keys, _pages(PAGES, payload)) == PAGES

        anyio.run(write)
        unreadable = FileBackend(path=str(root)).path_of(keys[2])
        if os.geteuid() == 0:
            os.chmod(root, 0o755)  # the tier writes its folders 0700 and pages 0600: opened to others here
            for shard in root.iterdir():
                shard.chmod(0o755)
                for page in shard.iterdir():
                    page.chmod(0o644)
        unreadable.chmod(0o000)
        if os.geteuid() == 0:
            result = _as_nobody(_read_five_times, root, keys, payload)
        else:
            result = _read_five_times(root, keys, payload)
        assert result["got"][0] == [2, "unreadable"]  # the pages before the unreadable one, then why not
        assert all(done == 2 for done, _ in result["got"])
        assert result["leaked"] == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_symlinked_shard_folders_are_refused_for_reads_writes_and_unlinks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside = tmp_path / "pages", tmp_path / "elsewhere"
    outside.mkdir()
    payload = 4096
    k1, k2 = _keys(2)
    async with FileBackend(path=str(root), fsync="never", capacity=HEADER_BYTES + payload) as b:
        assert await b.set([k1], _pages(1, payload)) == 1
        shard = b.path_of(k1).parent
        shard.rename(outside / shard.name)  # the shard now lives elsewhere, reached only through a link
        shard.symlink_to(outside / shard.name)
        victim = outside / shard.name / b.path_of(k1).name
        assert victim.exists()
        caplog.set_level(logging.WARNING)
        async with FileBackend(path=str(root), fsync="never") as other:  # another process's view
            assert await other.exists([k1]) == 0 and other.stats().stored_pages == 0
        assert await b.get([k1], _pages(1, payload)) == 0
        assert b.stats().corrupt_pages == 1
        assert await b.set([k2], _pages(1, payload, seed=3)) == 1  # evicts k1 (capacity: one page)...
        assert victim.exists()  # ...without unlinking through the link
        await b.delete([k1])
        assert victim.exists()
        assert await b.set([k1], _pages(1, payload, seed=4)) == 0  # never written through the link
        assert victim.read_bytes() == bytes(_pages(1, payload)[0].header) + bytes(_pages(1, payload)[0].payload[0])
        assert sorted(p.name for p in (outside / shard.name).iterdir()) == [victim.name]
        await b.clear()
        assert victim.exists() and shard.is_symlink()
    assert "symbolic link" in caplog.text and "refusing to follow" in caplog.text
    assert caplog.text.count("refusing to follow") == 2  # once per backend (two here), not once per page
