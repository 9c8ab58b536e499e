"""Issue 19's scenario through vLLM: a staging pool of 9 pages, a host tier of 2, prompts of 7 pages.

vLLM's KV holds 11 blocks (its 64 MiB with SmolLM2-135M in float32), hicache's staging (device)
pool 9 pages, its host tier 2 pages, write-through to a file tier. Each 900-token prompt saves 7
pages, a radix node larger than the host: it reaches the file tier run by run, and its staging
pages become free for the next save. Before the fix, after the first prompt the idle cache kept 6
staging pages it could not move and skipped every later save. Then vLLM's prefix cache is reset and
the same prompts come back at once (a burst: queued requests prefetch while one runs): each loads
its 7 blocks from the file tier through the 2-page host, run by run, and vLLM's greedy outputs are
the ones it computed the first time.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from .test_vllm_connector import BLOCK, run_engine

pytestmark = [pytest.mark.slow]

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32; a page is one 128-token vLLM block.
PAGE_BYTES = 2 * 30 * BLOCK * 3 * 64 * 4
PROMPT_PAGES = 7
RNG = random.Random(19)
PROMPTS = [[RNG.randrange(100, 49000) for _ in range(PROMPT_PAGES * BLOCK + 4)] for _ in range(4)]


def test_a_host_smaller_than_a_prompt_neither_skips_saves_nor_cuts_loads(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    connector = {
        "staging_tokens": 9 * BLOCK,
        "overrides": {
            "tiers": {"host": {"capacity": 2 * PAGE_BYTES},
                      "storage": [{"kind": "file", "path": str(pages), "fsync": "never"}]},
            "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
        },
    }
    run = run_engine(tmp_path, "small-host", {
        "mode": "single", "connector": connector,
        "phases": [
            {"kind": "generate", "prompts": PROMPTS},
            {"kind": "stats"},
            {"kind": "reset_prefix_cache"},
            {"kind": "generate", "prompts": PROMPTS, "burst": True},
            {"kind": "stats"},
            {"kind": "check_consistent"},
        ],
    })
    first, saved, _, again, loaded, consistent = run["phases"]
    tiers = saved["cache"]["tiers"]
    assert (tiers["device"]["capacity_pages"], tiers["host"]["capacity_pages"]) == (9, 2)

    # Every prompt's 7 pages were saved (none skipped for want of staging room) and written through.
    assert saved["connector"]["save_skipped_pages"] == 0, saved["connector"]
    assert saved["connector"]["saved_tokens"] == len(PROMPTS) * PROMPT_PAGES * BLOCK
    assert saved["cache"]["storage_backups"] >= len(PROMPTS) * PROMPT_PAGES
    assert all(t["lost_pages"] == 0 for t in tiers.values())

    # After the reset, each prompt's 7 blocks come from hicache, whole: nothing recomputed.
    assert [o["tokens"] for o in again["outputs"]] == [o["tokens"] for o in first["outputs"]]
    assert [o["cached"] for o in again["outputs"]] == [PROMPT_PAGES * BLOCK] * len(PROMPTS)
    c = loaded["connector"]
    assert c["load_failures"] == 0 and c["failed_tokens"] == 0, c
    assert c["loaded_tokens"] == len(PROMPTS) * PROMPT_PAGES * BLOCK
    assert c["loaded_by_tier"].get("file", 0) > 0, c["loaded_by_tier"]
    assert loaded["cache"]["short_retrieves"] == 0
    assert all(t["lost_pages"] == 0 for t in loaded["cache"]["tiers"].values())
    assert loaded["open_steps"] == 0 and loaded["held_prefetches"] == 0
    assert consistent["consistent"]
    assert sum(1 for _ in pages.glob("*/*.kv")) == len(PROMPTS) * PROMPT_PAGES
    assert "not written there" not in run["log"]
