"""Prefill/decode disaggregation of a sliding-window hybrid: Gemma 3 270M (real weights) in two
`vllm serve` processes with vLLM's hybrid KV cache manager on, hicache between them.

As ``test_vllm_pd.py`` (whose servers, proxy and checks this reuses), with Gemma 3: one block
table per KV cache group on both servers, the decode server's sliding groups holding only the
window's blocks (vLLM's null block before it). Prompts of 6 blocks (768 tokens, 1.5 windows), 3
and 5 cross through Valkey: through the proxy the greedy outputs are those of the decode server
alone, and the decode server computes one token of each prompt, the rest arrived from the prefill
server; nothing failed on either side.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from hicache.bench.models import gemma3_dir

from .test_vllm_pd import BLOCK, PD, check_through_the_proxy, pd_servers

pytestmark = [pytest.mark.slow]

RNG = random.Random(52)
PROMPTS = {name: [RNG.randrange(1000, 200_000) for _ in range(blocks * BLOCK + 1)]
           for name, blocks in (("long", 6), ("short", 3), ("stream", 5))}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, valkey: Any) -> Iterator[PD]:
    tmp = tmp_path_factory.mktemp("pd-gemma3")
    with pd_servers(tmp, valkey.port, PROMPTS, model=gemma3_dir(), kv_cache_bytes=256 << 20) as state:
        yield state


def test_a_sliding_window_model_crosses_from_prefill_to_decode_with_the_same_outputs(pd: PD) -> None:
    check_through_the_proxy(pd, PROMPTS, ["long", "short"], "stream")
