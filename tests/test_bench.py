"""The benchmarks end to end at a tiny size (real subprocesses, real model), and their parts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hicache.bench.cli import build_parser, run_benchmark
from hicache.bench.driver import DriverSettings, drive
from hicache.bench.scenarios import Sizing, cache_config, device_tokens
from hicache.bench.workloads import LongContext, MultiTurn
from hicache.engine import Engine
from hicache.integrations.transformers import CachedCausalLM

from .lm_helpers import tiny_model

DIST = {"mean", "p50", "p90", "p99"}
SUMMARY = {
    "requests", "duration_s", "ttft_s", "itl_s", "prefill_s", "queue_s", "input_tokens", "output_tokens",
    "input_tok_s", "output_tok_s", "hit_rate", "ideal_hit_rate", "hit_vs_ideal", "hit_rate_by_tier", "per_round",
}
CONFIGS = ["no-cache", "device-only", "hierarchical", "warm-restart"]


def bench(tmp_path: Path, *argv: str) -> dict:
    args = build_parser().parse_args([*argv, "--model", "tiny", "--quiet", "--out", str(tmp_path / "out")])
    return run_benchmark(args)


@pytest.mark.slow
def test_the_multiturn_benchmark_runs_end_to_end_and_reports_every_field(tmp_path: Path) -> None:
    report = bench(tmp_path, "multiturn", "--num-clients", "3", "--num-rounds", "4", "--request-length", "40",
                   "--output-length", "3", "--round-barrier")
    out = tmp_path / "out"
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["summary"].keys() == set(CONFIGS)
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in CONFIGS:
        s = on_disk["summary"][name]
        assert SUMMARY <= s.keys(), SUMMARY - s.keys()
        assert DIST <= s["ttft_s"].keys() and DIST <= s["itl_s"].keys()
        assert s["requests"] == 12 and s["output_tokens"] == 36
        assert [r["round"] for r in s["per_round"]] == [0, 1, 2, 3]
        assert s["outputs_differ_from_no-cache"] == 0  # greedy answers identical in every configuration
        assert len(on_disk["configurations"][name]["records"]) == 12
    hier, warm = on_disk["summary"]["hierarchical"], on_disk["summary"]["warm-restart"]
    assert on_disk["summary"]["no-cache"]["hit_rate"] == 0
    assert {"device", "host", "file"} <= hier["hit_rate_by_tier"].keys()
    assert 0.9 <= hier["hit_vs_ideal"] <= 1.0
    assert warm["per_round"][0]["hit_rate"] == 32 / 40  # round 0 (2 of its 2.5 pages) was stored by the last process
    assert warm["hit_rate_by_tier"]["file"] > 0
    assert on_disk["summary"]["device-only"]["hit_rate_by_tier"].get("file", 0) == 0
    assert set(report["targets"]) == {
        "hierarchical_hit_vs_ideal", "ttft_no_cache_over_hierarchical",
        "ttft_device_only_over_hierarchical", "ttft_warm_restart_over_hierarchical",
    }
    assert on_disk["configurations"]["device-only"]["cache_config"]["tiers"]["host"]["capacity"] == "0B"


@pytest.mark.slow
def test_the_long_context_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    report = bench(tmp_path, "long-context", "--num-documents", "2", "--document-length", "96",
                   "--questions-per-document", "3", "--question-length", "8", "--output-length", "2",
                   "--configs", "no-cache,hierarchical", "--no-plot", "--device-fraction", "0.5")
    # (at this size a document is 38% of the KV: a quarter of it on the device could not hold one)
    hier = report["summary"]["hierarchical"]
    assert hier["requests"] == 6
    assert hier["ideal_hit_rate"] == pytest.approx(4 * 96 / (6 * 104))  # later questions share their document
    assert hier["hit_rate"] == pytest.approx(hier["ideal_hit_rate"], rel=0.1)
    assert not (tmp_path / "out" / "plot.png").exists()


def test_warm_restart_needs_hierarchical_before_it(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="hierarchical"):
        bench(tmp_path, "multiturn", "--configs", "warm-restart")


async def test_the_driver_measures_the_ideal_hit_and_keeps_round_barriers() -> None:
    model = tiny_model()
    workload = MultiTurn(clients=3, rounds=3, request_len=20, output_len=2)
    settings = DriverSettings(max_parallel=2, ready_queue="random", round_barrier=True, seed=3)
    async with Engine(CachedCausalLM(model, None), max_running=2) as engine:
        records = await drive(engine, workload.conversations(1000), settings)
    assert len(records) == 9
    for r in records:  # each turn's prompt is the previous prompt and answer plus 20 new tokens
        assert r.prompt_tokens == 22 * r.round + 20
        assert r.ideal_tokens == 22 * r.round
    for k in (1, 2):  # no round starts before the previous one has finished
        assert min(r.arrival_s for r in records if r.round == k) >= max(r.finished_s for r in records if r.round == k - 1)


async def test_poisson_arrivals_follow_the_request_rate() -> None:
    model = tiny_model()
    workload = LongContext(documents=1, document_len=16, questions=40, question_len=4, output_len=1)
    settings = DriverSettings(request_rate=200.0, max_parallel=64, seed=1)
    async with Engine(CachedCausalLM(model, None), max_running=64) as engine:
        records = await drive(engine, workload.conversations(1000), settings)
    span = max(r.arrival_s for r in records) - min(r.arrival_s for r in records)
    assert 39 / 200 * 0.4 < span < 39 / 200 * 3  # 39 gaps of mean 5 ms (loose: a shared machine)


def test_configurations_size_the_tiers_from_the_workload(tmp_path: Path) -> None:
    model = tiny_model()
    kv_tokens = MultiTurn(clients=4, rounds=10, request_len=60, output_len=4).kv_tokens()  # 2560 tokens
    base = str(Path(__file__).resolve().parent.parent / "config" / "bench.yaml")
    sizing = Sizing()
    assert cache_config("no-cache", model, kv_tokens, sizing, base, str(tmp_path)) is None
    dev = cache_config("device-only", model, kv_tokens, sizing, base, str(tmp_path))
    hier = cache_config("hierarchical", model, kv_tokens, sizing, base, str(tmp_path))
    assert dev is not None and hier is not None
    page_tokens = dev.page_size
    assert dev.tiers.device.capacity // dev.page_bytes * page_tokens == device_tokens(kv_tokens, sizing, page_tokens)
    assert math.isclose(dev.tiers.device.capacity / dev.page_bytes * page_tokens, 0.25 * kv_tokens, rel_tol=0.01)
    assert dev.tiers.host.capacity == 0 and not dev.tiers.storage
    assert math.isclose(hier.tiers.host.capacity / hier.page_bytes * page_tokens, 0.5 * kv_tokens, rel_tol=0.01)
    assert [t.kind for t in hier.tiers.storage] == ["file"]
    assert hier.model.revision and hier.model.num_layers == 2
