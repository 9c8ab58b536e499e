"""NVIDIA Dynamo's own KV indexer (1.6.1, ``python -m dynamo.indexer``: the index its KV router scores
with) fed hicache's events over ZMQ predicts every served hit, and reads hicache's media as its tiers.

The indexer runs from ``.venv-dynamo`` (``make venv-dynamo``; ``make test`` builds it), subscribed to
the cache's publisher on loopback, and is asked over HTTP (``/query``) before each request of a
multi-turn trace whose tiers are all too small, as a router asks before placing the request.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import anyio
import pytest

pytest.importorskip("zmq")

from hicache import HiCache  # noqa: E402

from .conftest import make_kv, make_tokens  # noqa: E402
from .test_kv_events import PAGE, events_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"

pytestmark = pytest.mark.skipif(not DYNAMO_PYTHON.exists(), reason="no .venv-dynamo: `make venv-dynamo`")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(port: int, path: str, body: dict | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read() or b"null")


def _query(port: int, tokens: list[int]) -> dict[str, int]:
    got = _http(port, "/query", {"token_ids": tokens, "model_name": "default"})
    return (got or {}).get("instances", {}).get("1") or {"longest_matched": 0, "gpu": 0, "cpu": 0, "disk": 0}


async def _settled(port: int, tokens: list[int], want: int, timeout_s: float = 3.0) -> dict[str, int]:
    """The indexer applies events on its own threads: its answer once it equals ``want`` (or the
    last one at the deadline: then the assertion shows the difference)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await anyio.to_thread.run_sync(_query, port, tokens)
        if got["longest_matched"] == want or time.monotonic() > deadline:
            return got
        await anyio.sleep(0.05)


async def test_dynamos_indexer_predicts_every_served_hit(tmp_path: Path) -> None:
    pub, replay, http_port = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}", _port()
    cfg = events_config(tmp_path)
    cfg = cfg.model_copy(update={"kv_events": cfg.kv_events.model_copy(update={"endpoint": pub, "replay_endpoint": replay})})
    indexer = None
    log_path = tmp_path / "dynamo-indexer.log"
    log = log_path.open("wb")
    chats = [make_tokens(2 * PAGE + 1, seed=s) for s in range(4)]
    results: list[tuple[int, int, dict[str, int]]] = []
    try:
        async with HiCache.from_config(cfg) as cache:
            indexer = subprocess.Popen(
                [str(DYNAMO_PYTHON), "-m", "dynamo.indexer", "--port", str(http_port), "--threads", "1"],
                stdout=log, stderr=subprocess.STDOUT, env={"DYN_LOG": "warn", "PATH": "/usr/bin:/bin"},
            )
            deadline = time.monotonic() + 60
            while True:  # up, and subscribed: a probe prefix shows up in its index
                try:
                    _http(http_port, "/health")
                    break
                except OSError:
                    if indexer.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"dynamo.indexer did not start: {log_path.read_text()[-2000:]}")
                    await anyio.sleep(0.1)
            # the worker, as a router registers it: its PUB endpoint and its replay endpoint (the
            # indexer asks for the batches it joined too late for, from sequence 0)
            _http(http_port, "/register", {"instance_id": 1, "endpoint": pub, "replay_endpoint": replay,
                                           "block_size": PAGE, "model_name": "default"})
            probe = make_tokens(2 * PAGE, seed=999)
            await cache.store(probe, make_kv(cache.config, len(probe)))
            await _settled(http_port, probe, 2 * PAGE, timeout_s=30)
            for turn in range(5):
                for c, step in ((c, step) for c in range(len(chats)) for step in range(2)):
                    chat = chats[c]
                    chat += make_tokens(PAGE + 1, seed=100 * turn + 10 * c + step)
                    await cache.wait_idle()
                    served_now = (await cache.lookup(chat, prefetch=False)).tokens
                    predicted = await _settled(http_port, chat, served_now)
                    async with cache.retrieve(chat) as view:
                        await view.wait_all()
                        served = view.tokens
                    results.append((predicted["longest_matched"], served, predicted))
                    await cache.store(chat, make_kv(cache.config, len(chat), seed=c))
    finally:
        if indexer is not None:
            indexer.terminate()
            indexer.wait(10)
        log.close()
    pairs = [(p, s) for p, s, _ in results]
    assert all(p == s for p, s in pairs), pairs
    # Dynamo reads hicache's media as its tiers (cumulative: gpu <= cpu <= disk tokens)
    assert any(d["cpu"] > d["gpu"] for _, _, d in results), results
    assert any(d["disk"] > d["cpu"] for _, _, d in results), results
    assert sum(s for _, s in pairs) > 0
