"""The benchmarks end to end at a tiny size (real subprocesses, real model), and their parts."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from hicache.bench.cli import base_spec, build_parser, run_benchmark
from hicache.bench.driver import DriverSettings, drive
from hicache.bench.oracle import OracleLM, StoppableClock
from hicache.bench.scenarios import Sizing, cache_config, device_tokens
from hicache.bench.workloads import LongContext, MultiTurn
from hicache.engine import Engine
from hicache.integrations.transformers import CachedCausalLM

from .lm_helpers import tiny_model

DIST = {"mean", "p50", "p90", "p99"}
SUMMARY = {
    "requests", "duration_s", "ttft_s", "itl_s", "prefill_s", "queue_s", "input_tokens", "output_tokens",
    "input_tok_s", "output_tok_s", "hit_rate", "ideal_hit_rate", "hit_vs_ideal", "hit_rate_by_tier", "per_round",
    "computed_ideal_hit_rate", "hit_vs_computed_ideal", "stages", "ttft_vs_oracle", "cpu_pressure", "ttft_cpu_s",
    "ttft_cpu_vs_oracle",
}
CONFIGS = ["no-cache", "oracle", "device-only", "hierarchical", "warm-restart"]


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
        assert s["ttft_vs_oracle"]["mean"] == pytest.approx(s["ttft_s"]["mean"] / on_disk["summary"]["oracle"]["ttft_s"]["mean"])
        stages = s["stages"]["mean_s"]
        assert stages["prefill_compute"] > 0 and stages["decode_compute"] > 0
        assert all(r["stages"].keys() == stages.keys() for r in on_disk["configurations"][name]["records"])
    oracle = on_disk["summary"]["oracle"]
    # The oracle serves exactly the page-aligned computed ideal: what a page-granular cache can reach.
    assert oracle["hit_vs_computed_ideal"] == 1.0 and oracle["hit_rate"] == oracle["computed_ideal_hit_rate"]
    assert on_disk["configurations"]["oracle"]["oracle"]["kept_bytes"] > 0
    hier, warm = on_disk["summary"]["hierarchical"], on_disk["summary"]["warm-restart"]
    assert on_disk["summary"]["no-cache"]["hit_rate"] == 0
    assert {"device", "host", "file"} <= hier["hit_rate_by_tier"].keys()
    assert 0.9 <= hier["hit_vs_ideal"] <= 1.0
    assert hier["hit_vs_computed_ideal"] == 1.0  # sized to hold everything: every computed page is served
    assert warm["per_round"][0]["hit_rate"] == 32 / 40  # round 0 (2 of its 2.5 pages) was stored by the last process
    assert warm["hit_rate_by_tier"]["file"] > 0
    assert on_disk["summary"]["device-only"]["hit_rate_by_tier"].get("file", 0) == 0
    assert {
        "hierarchical_hit_vs_ideal", "hierarchical_hit_vs_computed_ideal", "ttft_no_cache_over_hierarchical",
        "ttft_device_only_over_hierarchical", "ttft_warm_restart_over_hierarchical", "ttft_hierarchical_over_oracle",
    } <= set(report["targets"])
    assert on_disk["configurations"]["device-only"]["cache_config"]["tiers"]["host"]["capacity"] == "0B"
    assert not (out / "pages").exists()  # the file tier warm-restart read from is scratch: gone when the run ends


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
        # The answer's last token was never fed to the model: its KV was not computed.
        assert r.computed_ideal_tokens == max(0, 22 * r.round - 1)
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
    assert cache_config("oracle", model, kv_tokens, sizing, base, str(tmp_path)) is None
    memory = cache_config("memory", model, kv_tokens, Sizing(host_fraction=1.0), base, str(tmp_path))
    assert memory is not None and not memory.tiers.storage
    assert math.isclose(memory.tiers.host.capacity / memory.page_bytes * page_tokens, kv_tokens, rel_tol=0.01)


async def test_the_oracle_serves_every_computed_page_and_the_same_answers() -> None:
    model = tiny_model()
    workload = MultiTurn(clients=2, rounds=3, request_len=20, output_len=3)
    settings = DriverSettings(max_parallel=1, page_size=16)
    outputs = {}
    for name in ("no-cache", "oracle"):
        lm = OracleLM(model, 16) if name == "oracle" else CachedCausalLM(model, None)
        clocks = dict(clock=lm.clock, cpu_clock=lm.cpu_clock) if isinstance(lm, OracleLM) else {}
        async with Engine(lm, max_running=1, **clocks) as engine:
            records = await drive(engine, workload.conversations(1000), settings)
        outputs[name] = {(r.conversation, r.round): r.output for r in records}
        for r in records:
            # Page-aligned: the previous turn computed 23 r - 1 tokens of this prompt (its last answer
            # token never went through the model), so whole pages of them.
            assert r.computed_ideal_tokens == (23 * r.round - 1) // 16 * 16 if r.round else r.computed_ideal_tokens == 0
            assert r.cached_tokens == (r.computed_ideal_tokens if name == "oracle" else 0)
            assert (r.ttft_cpu_s is not None) == (name == "oracle")
        if name == "oracle":
            assert lm.clock.stopped_s > 0 and sum(r.cached_tokens for r in records) > 0
    assert outputs["oracle"] == outputs["no-cache"]


def test_the_oracle_keeps_pages_in_a_preallocated_arena_that_grows() -> None:
    import torch

    from hicache.bench.oracle import PageArena

    arena = PageArena((2, 3), torch.float32, torch.device("cpu"), pages=2)
    pages = {bytes([i]): torch.full((2, 3), float(i)) for i in range(5)}
    for key, page in pages.items():
        arena.keep(key, page)
        arena.keep(key, page + 100)  # a key kept once: the first copy stays
    assert len(arena) == 5 and arena.kept_bytes == 5 * 6 * 4
    assert all(torch.equal(arena[k], p) for k, p in pages.items()) and b"x" not in arena


def test_the_oracle_clock_does_not_advance_while_stopped() -> None:
    clock = StoppableClock()
    start = clock()
    with clock.stopped():
        frozen = clock()
        time.sleep(0.05)
        assert clock() == frozen
    time.sleep(0.01)
    assert 0.005 < clock() - start < 0.045 and clock.stopped_s >= 0.05


def test_sequential_runs_one_request_at_a_time(tmp_path: Path) -> None:
    plain = base_spec(build_parser().parse_args(["multiturn", "--max-parallel", "3"]), tmp_path)
    assert plain.driver["max_parallel"] == 3 and plain.max_running == 4
    one = base_spec(build_parser().parse_args(["multiturn", "--max-parallel", "3", "--sequential"]), tmp_path)
    assert one.driver["max_parallel"] == 1 and one.max_running == 1


def test_records_of_other_engines_need_only_the_common_fields() -> None:
    # `hicache bench vllm` (vllm_worker.py) builds records without the hicache engine's timers.
    import dataclasses

    from hicache.bench.driver import Record
    from hicache.bench.report import add_oracle_ratios, format_table, summarise

    r = Record(conversation=0, round=0, prompt_tokens=10, cached_tokens=5, ideal_tokens=6, by_tier={"vllm": 5},
               ttft_s=0.1, queue_s=0.01, prefill_s=0.09, itl_s=[0.01], arrival_s=0.0, finished_s=0.2, output=[1, 2])
    summaries = {"vllm": summarise([dataclasses.asdict(r)], 1.0)}
    add_oracle_ratios(summaries)
    s = summaries["vllm"]
    assert s["hit_rate"] == 0.5 and math.isnan(s["computed_ideal_hit_rate"]) and math.isnan(s["hit_vs_computed_ideal"])
    assert "vllm" in format_table(summaries, ["vllm"], base_name="vllm")


@pytest.mark.slow
def test_the_benchmark_writes_each_configurations_metrics(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    report = bench(tmp_path, "multiturn", "--num-clients", "2", "--num-rounds", "3", "--request-length", "40",
                   "--output-length", "2", "--configs", "no-cache,hierarchical", "--no-plot", "--metrics")
    for name in ("no-cache", "hierarchical"):
        text = (tmp_path / "out" / f"metrics-{name}.prom").read_text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("hicache_engine_ttft_seconds_count", ())] == 6  # one per request
        assert samples[("hicache_engine_requests_total", (("outcome", "finished"),))] == 6
        cached = sum(v for (n, _), v in samples.items() if n == "hicache_engine_cached_tokens_by_tier_total")
        records = report["configurations"][name]["records"]
        assert cached == sum(r["cached_tokens"] for r in records)
        stats = report["configurations"][name]["cache_stats"]
        if name == "no-cache":
            assert stats is None and not any(n.startswith("hicache_tier_") for n, _ in samples)
            continue
        assert cached > 0
        assert samples[("hicache_stores_total", ())] == stats["stores"]
        hits = {dict(labels)["tier"]: v for (n, labels), v in samples.items() if n == "hicache_tier_hit_tokens_total"}
        tiers = stats["tiers"] | stats["storage"]
        assert hits == {tier: t["hit_tokens"] for tier, t in tiers.items()} and hits["file"] > 0


def test_metrics_needs_the_metrics_extra_or_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "prometheus_client" else real(n, *a))
    with pytest.raises(SystemExit, match="hicache\\[metrics\\]"):
        bench(tmp_path, "multiturn", "--configs", "no-cache", "--metrics")


def test_repeats_alternate_the_order_and_keep_warm_restart_after_hierarchical() -> None:
    from hicache.bench.repeats import run_order

    assert run_order(["no-cache", "oracle", "memory"], 3) == [
        ["no-cache", "oracle", "memory"], ["memory", "oracle", "no-cache"], ["no-cache", "oracle", "memory"]]
    assert run_order(["oracle", "hierarchical", "warm-restart", "memory"], 2) == [
        ["oracle", "hierarchical", "warm-restart", "memory"], ["memory", "hierarchical", "warm-restart", "oracle"]]
    assert run_order(["oracle", "hierarchical"], 1) == [["oracle", "hierarchical"]]


@pytest.mark.slow
def test_repeats_pool_every_run_and_report_each_ones_ratios(tmp_path: Path) -> None:
    report = bench(tmp_path, "multiturn", "--num-clients", "2", "--num-rounds", "3", "--request-length", "40",
                   "--output-length", "2", "--configs", "oracle,memory", "--host-fraction", "1.5",
                   "--no-plot", "--repeat", "2")
    assert [r["order"] for r in report["repeats"]] == [["oracle", "memory"], ["memory", "oracle"]]
    for name in ("oracle", "memory"):
        s, records = report["summary"][name], report["configurations"][name]["records"]
        assert s["requests"] == 12 and s["repeats"] == 2 and sorted({r["repeat"] for r in records}) == [0, 1]
        assert s["outputs_differ_from_oracle"] == 0
        # the pooled mean is the mean of the repeats' means (each repeat serves the same requests)
        each = [r["ttft_mean_s"][name] for r in report["repeats"]]
        assert s["ttft_s"]["mean"] == pytest.approx(sum(each) / 2)
        assert s["duration_s"] < sum(r["finished_s"] for r in records)  # summed per run, not across clocks
    ratios = [r["targets"]["ttft_memory_over_oracle"]["value"] for r in report["repeats"]]
    assert all(v > 0 for v in ratios) and report["targets"]["ttft_memory_over_oracle"]["value"] == pytest.approx(
        report["summary"]["memory"]["ttft_s"]["mean"] / report["summary"]["oracle"]["ttft_s"]["mean"])
    assert len(report["configurations"]["memory"]["cache_stats_by_repeat"]) == 2


async def test_lockstep_alternates_the_order_each_round_and_skips_the_finished() -> None:
    import anyio

    from hicache.bench.interleave import Lockstep

    lockstep = Lockstep(["a", "b", "c"])
    turns: list[str] = []

    async def client(name: str, requests: int) -> None:
        for _ in range(requests):
            await lockstep.acquire(name)
            turns.append(name)
            await anyio.sleep(0)  # others try to cut in meanwhile
            lockstep.release(name)
        lockstep.finished(name)

    async with anyio.create_task_group() as tg:
        for name, requests in (("c", 3), ("b", 3), ("a", 2)):  # started out of order; a leaves early
            tg.start_soon(client, name, requests)
    assert turns == ["a", "b", "c", "c", "b", "a", "b", "c"]


@pytest.mark.slow
def test_interleaved_configurations_take_turns_in_one_process(tmp_path: Path) -> None:
    report = bench(tmp_path, "multiturn", "--num-clients", "2", "--num-rounds", "3", "--request-length", "40",
                   "--output-length", "2", "--configs", "no-cache,oracle,hierarchical", "--sequential",
                   "--interleave", "--no-plot")
    runs = report["configurations"]
    for name in ("no-cache", "oracle", "hierarchical"):
        assert runs[name]["interleaved_with"] == ["no-cache", "oracle", "hierarchical"]
        assert report["summary"][name]["requests"] == 6 and report["summary"][name]["outputs_differ_from_no-cache"] == 0
        assert report["summary"][name]["duration_s"] == pytest.approx(runs[name]["wall_s"])  # its own turns
    assert report["summary"]["hierarchical"]["hit_rate"] > 0.3
    assert len(runs["hierarchical"]["drain_s"]) == 6 and runs["hierarchical"]["cache_stats"]["stores"] > 0
    # request k of every configuration, one after the other, in alternating order
    starts = {name: runs[name]["turn_started_s"] for name in runs}
    for k in range(6):
        order = sorted(runs, key=lambda name: starts[name][k])
        assert order == (["no-cache", "oracle", "hierarchical"] if k % 2 == 0 else ["hierarchical", "oracle", "no-cache"])
        assert k == 5 or max(s[k] for s in starts.values()) < min(s[k + 1] for s in starts.values())


def test_interleave_says_what_it_needs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--sequential"):
        bench(tmp_path, "multiturn", "--configs", "no-cache,oracle", "--interleave")
    with pytest.raises(SystemExit, match="warm-restart"):
        bench(tmp_path, "multiturn", "--configs", "hierarchical,warm-restart", "--interleave", "--sequential")


def test_prefills_that_shared_a_step_are_counted() -> None:
    from hicache.bench.vllm_overhead import _shared_prefills

    def rec(arrival: float, ttft: float) -> dict[str, float]:
        return {"arrival_s": arrival, "ttft_s": ttft}

    # two pairs arriving together: the first pair's prefills ran in one step (first tokens together),
    # the second pair's one after the other (the second waited a whole prefill)
    batched = [rec(0.0, 3.9), rec(0.0, 3.91)]
    alternated = [rec(5.0, 2.0), rec(5.0, 3.9)]
    assert _shared_prefills(batched + alternated) == 2
    assert _shared_prefills(alternated) == 0
    assert _shared_prefills([rec(0.0, 1.0)]) == 0


def test_a_runs_tier_pages_are_removed_when_it_ends_unless_kept(tmp_path: Path) -> None:
    from hicache.bench.scratch import pages_removed

    def tier(name: str) -> Path:
        folder = tmp_path / name / "ab"
        folder.mkdir(parents=True)
        (folder / "page.kv").write_bytes(b"x" * 100)
        return tmp_path / name

    pages, other = tier("pages"), tier("mine")
    (tmp_path / "results.json").write_text("{}")
    with pages_removed([pages, tmp_path / "never-made"]):
        assert (pages / "ab" / "page.kv").exists()
    assert not pages.exists() and (other / "ab" / "page.kv").exists() and (tmp_path / "results.json").exists()

    pages = tier("pages")
    with pytest.raises(KeyboardInterrupt), pages_removed([pages]):
        raise KeyboardInterrupt  # a run cut short leaves nothing either
    assert not pages.exists()

    pages = tier("pages")
    with pages_removed([pages], keep=True):
        pass
    assert (pages / "ab" / "page.kv").exists()

    pages.rename(tmp_path / "target")
    pages.symlink_to(tmp_path / "target")  # not a folder the run made: left alone, and not followed
    with pages_removed([pages]):
        pass
    assert (tmp_path / "target" / "ab" / "page.kv").exists()
