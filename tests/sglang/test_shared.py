"""Two SGLang processes share the file tier and a real Valkey server: each reads, bit for bit, what the
other wrote (the second process is ``peer.py``, with its own host pool and backends)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .harness import backend, fill, page_bytes, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")

ROOT = Path(__file__).resolve().parents[2]
PAGES = 20


def digest(host: Any, slots: Any) -> str:
    return hashlib.sha256(page_bytes(host, slots).numpy().tobytes()).hexdigest()


def test_two_processes_share_the_file_tier_and_valkey(tmp_path: Path, valkey: Any) -> None:
    tiers = {
        "file": {"storage": [{"kind": "file", "path": str(tmp_path / "pages")}]},
        "valkey": {"storage": [{"kind": "redis", "url": f"redis://127.0.0.1:{valkey.port}/0", "key_prefix": "sgl-shared"}]},
    }
    args = {"tiers": tiers, "pages": PAGES, "write": [1, 2], "read": 3}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_WAIT_POLICY": "PASSIVE"}
    peer = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang.peer", json.dumps(args)], cwd=ROOT, env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    _, host = pools("page_first")
    ps = host.page_size
    backends = {name: backend(host, {"interface_v1": 1, **extra}) for name, extra in tiers.items()}
    try:
        line = peer.stdout.readline()
        assert line, f"the peer died: {peer.stderr.read()[-3000:]}"
        theirs = json.loads(line)["written"]
        their_tokens = tokens_for(PAGES, ps, seed=1)
        for name, b in backends.items():  # what the other process wrote, read here
            assert b.batch_exists(page_hashes(their_tokens, ps)) == PAGES, name
            slots = host.alloc(PAGES * ps)
            assert all(b.batch_get_v1(page_hashes(their_tokens, ps), slots)), name
            assert digest(host, slots) == theirs[name], name
            host.free(slots)
        mine = tokens_for(PAGES, ps, seed=3)  # and what this one writes, read there
        slots = host.alloc(PAGES * ps)
        fill(host, slots, seed=4)
        for b in backends.values():
            assert all(b.batch_set_v1(page_hashes(mine, ps), slots))
        out, err = peer.communicate("go\n", timeout=120)
        assert peer.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["read"] == {name: digest(host, slots) for name in tiers}
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        for b in backends.values():
            b.close()
