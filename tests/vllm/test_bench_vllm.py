"""`hicache bench vllm` end to end at a tiny size: all three configurations run, the JSON holds the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]


def test_bench_vllm_runs_every_configuration_and_reports_identical_outputs_and_the_step_profile(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HICACHE_VLLM_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "bench", "vllm", "--num-clients", "2", "--num-rounds", "2",
         "--max-parallel", "1", "--out", str(tmp_path / "out"), "--quiet", "--no-plot"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "vllm-unbounded" in proc.stdout and "TTFT mean" in proc.stdout and "critical path" in proc.stdout
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    summary = report["summary"]
    assert [summary[c]["requests"] for c in ("vllm", "vllm+hicache", "vllm-unbounded")] == [4, 4, 4]
    assert summary["vllm+hicache"]["outputs_differ_from_vllm"] == 0
    assert summary["vllm-unbounded"]["outputs_differ_from_vllm"] == 0
    # A round-1 prompt (260 tokens) starts with its round-0 prompt, whose first 128-token block
    # was saved: at least that block is served (by vLLM's prefix cache or from hicache).
    assert summary["vllm+hicache"]["per_round"][1]["hit_rate"] >= 128 / 260
    assert report["targets"]["outputs_differing"]["met"]
    # The limit's KV holds the whole trace and the running request; vLLM's the running request.
    sizes = report["sizes"]
    assert sizes["unbounded_kv_tokens"] >= sizes["kv_tokens"] + sizes["max_model_len"]
    assert sizes["vllm_kv_tokens"] >= sizes["max_model_len"]
    stats = report["configurations"]["vllm+hicache"]["cache_stats"]
    assert stats["connector"]["saved_tokens"] >= 4 * 128 and stats["open_steps"] == 0
    profile = report["connector_profile"]
    assert profile["hooks_per_request"]["worker.save"]["calls"] > 0 and profile["critical_path_ms_per_request"] > 0
    assert profile["loads_cut_short"] == 0
    assert {"ttft_gap_ms", "connector_ms", "recompute_ms", "other_ms"} <= set(report["ttft_breakdown"])
    assert "of tier pages" in proc.stderr and not (tmp_path / "out" / "pages").exists()  # scratch, removed at the end


def test_bench_vllm_interleave_runs_the_configurations_together_taking_turns(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HICACHE_VLLM_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "bench", "vllm", "--num-clients", "2", "--num-rounds", "2",
         "--max-parallel", "1", "--interleave", "--configs", "vllm+hicache,vllm-unbounded",
         "--out", str(tmp_path / "out"), "--quiet", "--no-plot"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "interleaved turns wait for it" in proc.stdout
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["driver"]["interleave"] is True
    summary, runs = report["summary"], report["configurations"]
    assert [summary[c]["requests"] for c in ("vllm+hicache", "vllm-unbounded")] == [4, 4]
    assert summary["vllm-unbounded"]["outputs_differ_from_vllm+hicache"] == 0
    assert summary["vllm+hicache"]["drain_s"]["mean"] >= 0 and len(runs["vllm+hicache"]["drain_s"]) == 4
    # A configuration's duration is its own turns' time, not the span the other's turns ran through.
    spans = {c: max(r["finished_s"] for r in runs[c]["records"]) for c in runs}
    assert all(runs[c]["wall_s"] < spans[c] for c in runs)
    assert report["targets"]["outputs_differing"]["met"]


def test_bench_vllm_interleave_needs_one_request_at_a_time(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "bench", "vllm", "--interleave", "--max-parallel", "2",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode != 0 and "--interleave takes turns one request at a time" in proc.stderr
