"""hicache's KV events through vLLM's own publisher: a router's index predicts every served hit.

vLLM (SmolLM2-135M, float32, 64 MiB of KV: 10 blocks of 128 tokens) with the connector, a host tier
of 8 pages and a file tier of 16 (it evicts), `--kv-events-config` publishing on loopback. A
multi-turn trace of four chats (26 blocks of history: vLLM holds about a third of it, every tier is
too small) is sent one prompt at a time; before each, a subscriber's index (hicache.events.index.PrefixIndex, built from the batches
vLLM published so far: its own GPU blocks and hicache's CPU and DISK ones, under vLLM's block
hashes) predicts the hit, and vLLM's ``num_cached_tokens`` is the hit it served.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from .test_vllm_connector import BLOCK, run_engine

pytestmark = [pytest.mark.slow]

PAGE_BYTES = 2 * 30 * BLOCK * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trace(chats: int = 4, turns: int = 5) -> list[list[int]]:
    rng = random.Random(53)
    convs = [[rng.randrange(100, 49000) for _ in range(2 * BLOCK + 10)] for _ in range(chats)]
    prompts = []
    for _ in range(turns):
        for conv in convs:
            prompts.append(list(conv))
            conv += [rng.randrange(100, 49000) for _ in range(BLOCK)]  # the answer and the next question
    return prompts


def test_the_index_from_vllms_events_predicts_every_served_hit(tmp_path: Path) -> None:
    endpoint, replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    connector = {
        "overrides": {
            "tiers": {"host": {"capacity": 8 * PAGE_BYTES},
                      "storage": [{"kind": "file", "name": "disk", "path": str(tmp_path / "pages"), "fsync": "never",
                                   "capacity": 16 * PAGE_BYTES + 4096}]},
            "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
        },
    }
    # vLLM's ZMQ publisher binds only an endpoint with "*"; the subscriber connects to loopback.
    bind = {"endpoint": endpoint.replace("127.0.0.1", "*"), "replay_endpoint": replay.replace("127.0.0.1", "*")}
    run = run_engine(tmp_path, "kv-events", {
        "mode": "single", "connector": connector, "kv_events": bind,
        "phases": [
            {"kind": "routed", "prompts": _trace(), "endpoint": endpoint, "replay_endpoint": replay, "block": BLOCK},
            {"kind": "stats"},
        ],
    })
    routed, stats = run["phases"]
    outs = routed["outputs"]
    pairs = [(o["predicted"], o["served"]) for o in outs]
    assert all(p == s for p, s in pairs), pairs
    # hits came from vLLM's GPU blocks and from hicache's tiers below, and pages left every tier
    media = [m for o in outs for block in o["media"] for m in block]
    assert "GPU" in media and "CPU" in media and "DISK" in media, sorted(set(media))
    # hicache's tiers served part of the hits (vLLM alone would have computed those tokens)
    from_hicache = [o for o in outs if o["loaded"] and o["loaded"]["loaded_tokens"] > 0]
    assert len(from_hicache) >= 3, [o["loaded"] for o in outs]
    kinds = {k for batch in routed["batches"] for k in batch}
    assert {"BlockStored:CPU", "BlockStored:DISK", "BlockRemoved:CPU", "BlockRemoved:DISK", "BlockRemoved:GPU"} <= kinds, kinds
    assert routed["missed"] == 0
    assert stats["cache"]["storage"]["disk"]["backend"]["evicted_pages"] > 0
