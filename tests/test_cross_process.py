"""KV written by one process is found and reused, bit-exact, by another: real subprocesses, one folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np

from hicache import HiCache
from hicache.tiers.storage import PageIO
from hicache.tiers.storage.file import FileBackend
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec

from .remote_worker import config

ROOT = Path(__file__).resolve().parent.parent


def spawn(verb: str, root: Path, *rest: object) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.remote_worker", verb, json.dumps({"kind": "file", "path": str(root)}),
         *map(str, rest)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_process_reuses_the_first_ones_pages(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    stored = result(spawn("store", root, 0, 4))
    assert stored["stored_pages"] == 4 * 6 and stored["failures"] == 0
    checked = result(spawn("check", root, 0, 4))  # a fresh process: nothing in memory, only the folder
    assert checked["hits"] == [24] * 4
    assert checked["exact"] == [True] * 4
    assert checked["corrupt"] == 0 and checked["fetched"] == 24
    again = result(spawn("check", root, 0, 4))  # and after another restart
    assert again["exact"] == [True] * 4


def test_two_processes_writing_the_same_pages_leave_a_valid_store(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    writers = [spawn("store", root, 0, 24), spawn("store", root, 0, 24)]
    results = [result(w) for w in writers]
    assert all(r["failures"] == 0 for r in results)
    # Between them every page was written at least once (the later writer may skip what it finds).
    assert sum(r["stored_pages"] + r["skipped_pages"] for r in results) == 2 * 24 * 6
    assert not list(root.rglob("*.tmp"))
    assert anyio.run(count_valid_files, root) == 24 * 6
    checked = result(spawn("check", root, 0, 24))
    assert checked["exact"] == [True] * 24 and checked["corrupt"] == 0


async def count_valid_files(root: Path) -> int:
    """Every page file in ``root`` passes the header and checksum check; return how many there are."""
    cache = HiCache.from_config(config({"kind": "file", "path": str(root)}))  # built for its namespace and geometry, not opened
    codec = PageCodec(cache.namespace.digest, cache.controller.device.geometry)
    valid = 0
    async with FileBackend(path=str(root)) as backend:
        for path in root.rglob("*.kv"):
            key = bytes.fromhex(path.stem)
            header = np.zeros(HEADER_BYTES, np.uint8)
            payload = np.zeros(codec.payload_bytes, np.uint8)
            io = PageIO.of(header, payload)
            assert await backend.get([key], [io]) == 1
            assert codec.check(key, io.header, io.payload) is None, path
            valid += 1
    return valid
