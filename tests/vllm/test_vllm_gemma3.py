"""A sliding-window hybrid through vLLM with the hicache connector: Gemma 3 270M (real weights; five
512-token sliding layers to one global layer) on the CPU.

The connector does not implement vLLM's hybrid KV cache manager, so vLLM turns it off (its own
warning): one block table for all 18 layers, every token's KV kept, the window applied by the
attention kernel per layer. hicache then stores every layer's KV and a hit is exact. Three engine
processes share one file tier:

1. vLLM alone (hybrid manager on): the reference greedy outputs of a three-turn trace whose
   prompts are 1.4 to 3.7 windows long.
2. vLLM + hicache, single-process, vLLM's prefix cache reset before each turn: each turn's prefix
   comes from hicache's host tier, outputs equal.
3. vLLM + hicache, a fresh process: the last turn's prefix comes from the file tier process 2 wrote.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.models import gemma3_dir

from .test_vllm_connector import BLOCK, run_engine

pytestmark = [pytest.mark.slow]

RNG = random.Random(51)
TURNS = [[RNG.randrange(1000, 200_000) for _ in range(n)] for n in (700, 600, 600)]
PROMPTS = [sum(TURNS[: i + 1], []) for i in range(len(TURNS))]  # 700, 1300, 1900 tokens


def _spec(pages: Path | None, phases: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model_dir": str(gemma3_dir()), "mode": "single", "max_model_len": 2048, "kv_cache_bytes": 256 << 20,
        "phases": phases,
    }
    if pages is not None:
        spec["connector"] = {
            "overrides": {
                # 20 pages of 4.7 MB (128 tokens x 18 layers x 256 x 2 x 4 bytes): every turn's prefix
                "tiers": {"host": {"capacity": "96MiB"}, "storage": [{"kind": "file", "path": str(pages),
                                                                       "fsync": "never"}]},
                "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
            }
        }
    return spec


def _turns() -> list[dict[str, Any]]:
    phases: list[dict[str, Any]] = []
    for prompt in PROMPTS:
        phases += [{"kind": "reset_prefix_cache"}, {"kind": "generate", "prompts": [prompt], "max_tokens": 8}]
    return phases


def test_gemma3_greedy_outputs_are_vllms_own_with_hits_from_the_host_and_the_file_tier(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    alone = run_engine(tmp_path, "alone", _spec(None, _turns()))
    want = [p["outputs"][0]["tokens"] for p in alone["phases"][1::2]]

    cached = run_engine(tmp_path, "hicache", _spec(pages, [*_turns(), {"kind": "stats"}]))
    assert "Turning off hybrid kv cache manager" in cached["log"]
    outs = [p["outputs"][0] for p in cached["phases"][1:-1:2]]
    assert [o["tokens"] for o in outs] == want
    # Turn k's prompt holds turn k-1's whole blocks: vLLM's own cache was reset, so hicache served them.
    assert [o["cached"] for o in outs] == [0, 700 // BLOCK * BLOCK, 1300 // BLOCK * BLOCK]
    connector = cached["phases"][-1]["connector"]
    assert connector["loaded_by_tier"] == {"host": 640 + 1280} and connector["load_failures"] == 0, connector

    fresh = run_engine(tmp_path, "fresh", _spec(pages, [{"kind": "generate", "prompts": [PROMPTS[-1]],
                                                          "max_tokens": 8}, {"kind": "stats"}]))
    out = fresh["phases"][0]["outputs"][0]
    assert out["tokens"] == want[-1]
    assert out["cached"] == 1900 // BLOCK * BLOCK  # written by turn 3 of the previous process
    assert fresh["phases"][1]["connector"]["loaded_by_tier"] == {"file": out["cached"]}
