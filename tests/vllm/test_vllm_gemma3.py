"""A sliding-window hybrid through vLLM with the hicache connector: Gemma 3 270M (real weights; five
512-token sliding layers to one global layer) on the CPU.

The connector supports vLLM's hybrid KV cache manager, so vLLM keeps it on: one block table per
KV cache group (one full-attention group, five sliding ones), sliding groups freeing blocks behind
the window, loads that vLLM waits for. The file tier keeps each page's sliding layers only for the
window before a prefix end, and a page read back without them (thin) lands only where vLLM keeps
nothing (its null block). Engine processes, one file tier:

1. vLLM alone: the reference greedy outputs of a three-turn trace whose prompts are 1.4 to 3.7
   windows long, and of a probe that shares 1,100 tokens of the last prompt, then differs.
2. vLLM + hicache: the last prompt first (stored with its sliding layers for its last window only),
   then the earlier turns, vLLM's prefix cache reset before each: their prefixes come from the
   host tier; outputs equal.
3. vLLM + hicache, a fresh process: the last prompt's prefix comes from the file tier (pages 0-8
   thin), then the probe, whose prefix vLLM and hicache could only serve from those thin pages:
   computed, outputs equal.
4. vLLM + hicache with the hybrid manager off (one block table, every token's KV kept): storage
   keeps whole pages, the turns' prefixes come from the host tier, outputs equal.
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
PROBE = PROMPTS[-1][:1100] + [RNG.randrange(1000, 200_000) for _ in range(300)]


def _spec(pages: Path | None, phases: list[dict[str, Any]], hybrid_manager: bool | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model_dir": str(gemma3_dir()), "mode": "single", "max_model_len": 2048, "kv_cache_bytes": 256 << 20,
        "phases": phases, "hybrid_manager": hybrid_manager,
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


def _turns(order: list[int]) -> list[dict[str, Any]]:
    phases: list[dict[str, Any]] = []
    for i in order:
        phases += [{"kind": "reset_prefix_cache"}, {"kind": "generate", "prompts": [PROMPTS[i]], "max_tokens": 8}]
    return phases


def _outputs(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [p["outputs"][0] for p in run["phases"] if "outputs" in p]


def test_gemma3_greedy_outputs_are_vllms_own_with_hits_from_the_host_and_the_file_tier(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    probe = {"kind": "generate", "prompts": [PROBE], "max_tokens": 8}
    alone = _outputs(run_engine(tmp_path, "alone", _spec(None, [*_turns([0, 1, 2]), probe])))
    want, want_probe = [o["tokens"] for o in alone[:3]], alone[3]["tokens"]

    cached = run_engine(tmp_path, "hicache", _spec(pages, [*_turns([2, 0, 1]), {"kind": "stats"}]))
    assert "Turning off hybrid kv cache manager" not in cached["log"]
    outs = _outputs(cached)
    assert [o["tokens"] for o in outs] == [want[2], want[0], want[1]]
    # Each earlier turn's whole blocks are a prefix of the last prompt, held by the host tier.
    assert [o["cached"] for o in outs] == [0, 700 // BLOCK * BLOCK, 1300 // BLOCK * BLOCK]
    connector = cached["phases"][-1]["connector"]
    assert connector["loaded_by_tier"] == {"host": 640 + 1280} and connector["load_failures"] == 0, connector

    fresh = run_engine(tmp_path, "fresh", _spec(pages, [{"kind": "generate", "prompts": [PROMPTS[-1]], "max_tokens": 8},
                                                        probe, {"kind": "stats"}]))
    last, probed = _outputs(fresh)
    assert last["tokens"] == want[-1]
    assert last["cached"] == 1900 // BLOCK * BLOCK  # written by the previous process
    assert probed["tokens"] == want_probe
    connector = fresh["phases"][-1]["connector"]
    assert connector["loaded_by_tier"] == {"file": last["cached"]} and connector["load_failures"] == 0, connector

    off = run_engine(tmp_path, "off", _spec(tmp_path / "whole", [*_turns([0, 1, 2]), {"kind": "stats"}],
                                            hybrid_manager=False))
    assert "storage tiers keep whole pages" in off["log"]
    outs = _outputs(off)
    assert [o["tokens"] for o in outs] == want
    assert [o["cached"] for o in outs] == [0, 700 // BLOCK * BLOCK, 1300 // BLOCK * BLOCK]
    assert off["phases"][-1]["connector"]["loaded_by_tier"] == {"host": 640 + 1280}
