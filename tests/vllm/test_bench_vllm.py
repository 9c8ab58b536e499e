"""`hicache bench vllm` end to end at a tiny size: both configurations run, the JSON holds the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]


def test_bench_vllm_runs_both_configurations_and_reports_identical_outputs(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HICACHE_VLLM_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "bench", "vllm", "--num-clients", "2", "--num-rounds", "2",
         "--out", str(tmp_path / "out"), "--quiet", "--no-plot"],
        env=env, capture_output=True, text=True, timeout=400, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "vllm+hicache" in proc.stdout and "TTFT mean" in proc.stdout
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    alone, cached = report["summary"]["vllm"], report["summary"]["vllm+hicache"]
    assert alone["requests"] == cached["requests"] == 4
    assert cached["outputs_differ_from_vllm"] == 0
    # A round-1 prompt (260 tokens) starts with its round-0 prompt, whose first 128-token block
    # was saved: at least that block is served (by vLLM's prefix cache or from hicache).
    assert cached["per_round"][1]["hit_rate"] >= 128 / 260
    assert report["targets"]["outputs_differing"]["met"]
    stats = report["configurations"]["vllm+hicache"]["cache_stats"]
    assert stats["connector"]["saved_tokens"] >= 4 * 128 and stats["open_steps"] == 0
