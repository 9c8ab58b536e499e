"""`hicache bench serve` end to end at a tiny size: `vllm serve` alone and with hicache, over HTTP.

Two servers are booted side by side (the default ``--boot together``), then streaming clients run
a small multi-turn trace against each in turn, the other idle or stopped. Checked: greedy outputs identical, the round-1 prompts served
from the cache (vLLM's prefix cache or hicache's tiers), TTFT and ITL measured at the client, the
hit rate split by tier from the connector's per-request records, each server's Prometheus scrape
written (hicache's families on vLLM's /metrics and on the worker's own endpoint), the step profile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]


def test_bench_serve_drives_vllm_serve_over_http_and_reports_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HICACHE_VLLM_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "bench", "serve", "multiturn", "--num-clients", "2", "--num-rounds", "2",
         "--request-length", "150", "--output-length", "4", "--max-parallel", "2", "--configs", "vllm,vllm+hicache",
         "--out", str(out), "--quiet", "--no-plot"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== multiturn" in proc.stdout and "outputs_differing: 0" in proc.stdout
    report = json.loads((out / "results.json").read_text())
    w = report["workloads"]["multiturn"]
    alone, cached = w["summary"]["vllm"], w["summary"]["vllm+hicache"]
    assert alone["requests"] == cached["requests"] == 4
    boots = {c: w["configurations"][c]["boot_together_s"] for c in ("vllm", "vllm+hicache")}
    assert boots["vllm"] == boots["vllm+hicache"] > 0  # one boot for both
    # Each server's own start time is its boot's, not the wait for its turn after it.
    starts = [next(iter(w["configurations"][c]["servers"].values()))["start_s"] for c in ("vllm", "vllm+hicache")]
    assert all(0 < s <= boots["vllm"] + 1 for s in starts), (starts, boots)
    assert cached["outputs_differ_from_vllm"] == 0
    # A round-1 prompt (304 tokens) starts with its round-0 prompt, whose first block was computed.
    assert cached["per_round"][1]["hit_rate"] >= 128 / 304
    records = w["configurations"]["vllm+hicache"]["records"]
    assert all(r["ttft_s"] > 0 and len(r["output"]) == 4 and len(r["itl_s"]) == 3 for r in records)
    assert all(sum(r["by_tier"].values()) == r["cached_tokens"] for r in records)  # split: vLLM + hicache tiers
    assert cached["input_tok_s"] > 0 and alone["requests_per_s"] > 0
    scrape = (out / "metrics-multiturn-vllm-hicache.prom").read_text()
    assert "vllm:prompt_tokens" in scrape and "hicache_vllm_saved_tokens_total" in scrape
    live = (out / "metrics-multiturn-vllm-hicache-worker.prom").read_text()
    assert "hicache_tier_used_pages" in live
    assert "hicache_" not in (out / "metrics-multiturn-vllm.prom").read_text()
    profile = w["connector_profile"]
    assert profile["saved_tokens"] >= 4 * 128 and profile["loads_cut_short"] == 0
    assert w["targets"]["outputs_differing"]["met"] and w["targets"]["loads_cut_short"]["met"]
    assert not (out / "pages-multiturn-vllm-hicache").exists()  # the file tier's pages: removed when the run ends
