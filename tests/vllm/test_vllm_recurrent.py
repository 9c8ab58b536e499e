"""Recurrent hybrids through vLLM with the hicache connector, on the CPU: a random Granite 4
(GraniteMoeHybrid: three Mamba-2 layers and one attention layer, ``tiny-granite4``), a random
LFM2 (three short-convolution layers and one attention layer, ``tiny-lfm2``) and, at the end, a
random Qwen3-Next (gated delta nets).

vLLM keeps each such layer in a (Mamba) KV cache group of its own and, with prefix caching ("align"
mode), offers the connector the state at the prompt's last block boundary before its last token;
hicache keeps it as that page's checkpoint (``integrations/vllm/recurrent.py``). vLLM's CPU Mamba
kernel cannot yet write a block boundary's state inside a longer chunk (``IndexError`` in
``mamba_mixer2``, with or without a connector), so every run here schedules at most one block a
step. A random model's greedy tokens barely depend on the state, so the sampled tokens' logprobs
are compared too: a Granite 4 state restored one block off, or not at all, moves them by ~1e-3.
Engine processes, one host and one file tier:

1. vLLM alone: the reference outputs of a prompt, its continuation and a branch off its third block.
2. vLLM + hicache, vLLM's prefix cache reset before each: the continuation continues from the
   prompt's checkpoint after 384 tokens (host tier); the branch shares 300 tokens, but no
   checkpoint lies before 384, so it is computed whole; outputs equal vLLM's own.
3. vLLM + hicache, a fresh process: the continuation's checkpoint after 640 tokens comes from the
   file tier; outputs equal.
4. The same, with every checkpoint in the file tier deleted: no hit at all (attention KV alone
   cannot be continued from), outputs equal.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.bench.models import MODELS, load_model

from .test_vllm_connector import run_engine

pytestmark = [pytest.mark.slow]

RNG = random.Random(52)
PROMPT = [RNG.randrange(3, 999) for _ in range(448)]
CONTINUED = PROMPT + [RNG.randrange(3, 999) for _ in range(200)]  # 648 tokens
BRANCH = PROMPT[:300] + [RNG.randrange(3, 999) for _ in range(200)]
ATOL = 2e-5


@pytest.fixture(scope="module", params=["tiny-granite4", "tiny-lfm2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny-granite4":
        load_model(request.param).save_pretrained(out)
        return out
    # LFM2 with 2 heads of 32 (vLLM's CPU attention has no kernel for 16), and the config fields
    # vLLM 0.32's LFM2 reads that transformers 5 no longer writes (the same values).
    import transformers

    preset = MODELS[request.param]
    assert preset.llama is not None
    config = getattr(transformers, preset.family)(**preset.llama | {"num_attention_heads": 2, "num_key_value_heads": 1})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.float32).save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw |= {"conv_dim": raw["hidden_size"], "conv_dim_out": raw["hidden_size"], "block_dim": raw["hidden_size"]}
    (out / "config.json").write_text(json.dumps(raw))
    return out


def _spec(model: Path, pages: Path | None, phases: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model_dir": str(model), "mode": "single", "max_model_len": 1024, "kv_cache_bytes": 64 << 20,
        "max_num_batched_tokens": 128, "skip_tokenizer_init": True, "enable_prefix_caching": True,
        "phases": phases, "connector": None,
    }
    if pages is not None:
        spec["connector"] = {"overrides": {
            "tiers": {"host": {"capacity": "16MiB"},
                      "storage": [{"kind": "file", "path": str(pages), "fsync": "never"}]},
            "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
        }}
    return spec


def _turns(prompts: list[list[int]]) -> list[dict[str, Any]]:
    phases: list[dict[str, Any]] = []
    for p in prompts:
        phases += [{"kind": "reset_prefix_cache"},
                   {"kind": "generate", "prompts": [p], "max_tokens": 8, "logprobs": True}]
    return phases


def _outputs(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [p["outputs"][0] for p in run["phases"] if "outputs" in p]


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=ATOL)


def test_outputs_are_vllms_own_with_mamba_checkpoints_from_the_host_and_the_file_tier(
    tmp_path: Path, model_dir: Path
) -> None:
    pages = tmp_path / "pages"
    alone = _outputs(run_engine(tmp_path, "alone", _spec(model_dir, None, _turns([PROMPT, CONTINUED, BRANCH]))))
    assert alone[1]["cached"] == 0  # the prefix cache was reset

    cached = run_engine(tmp_path, "hicache", _spec(model_dir, pages, [*_turns([PROMPT, CONTINUED, BRANCH]),
                                                                      {"kind": "stats"}]))
    outs = _outputs(cached)
    for got, want in zip(outs, alone):
        _same(got, want)
    assert [o["cached"] for o in outs] == [0, 384, 0]
    connector = cached["phases"][-1]["connector"]
    assert connector["loaded_by_tier"] == {"host": 384} and connector["load_failures"] == 0, connector

    fresh = run_engine(tmp_path, "fresh", _spec(model_dir, pages, [*_turns([CONTINUED]), {"kind": "stats"}]))
    (out,) = _outputs(fresh)
    _same(out, alone[1])
    assert out["cached"] == 640  # the continuation's own checkpoint, written by the previous process
    assert fresh["phases"][-1]["connector"]["loaded_by_tier"] == {"file": 640}

    # A page is 4 cache layers of 32 KiB: the attention layer's KV (the file tier's `layers:full`
    # part, 32 KiB and a header) and one slot per recurrent layer's state (Granite 4: 10,112 bytes,
    # LFM2: 768; `layers:state`, three slots): the checkpoints are the files over 64 KiB.
    files = [p for p in pages.rglob("*.kv") if p.is_file()]
    states = [p for p in files if p.stat().st_size > 64 << 10]
    # The prompt's after 384 tokens, the continuation's after 640, the branch's after its own 384;
    # pages: 5 of the continuation's, the branch's third.
    assert len(states) == 3 and len(files) == 6 + 3, sorted(p.stat().st_size for p in files)
    for p in states:
        p.unlink()
    gone = run_engine(tmp_path, "gone", _spec(model_dir, pages, [*_turns([CONTINUED]), {"kind": "stats"}]))
    (out,) = _outputs(gone)
    _same(out, alone[1])
    assert out["cached"] == 0


def test_qwen3_next_outputs_are_vllms_own_with_gated_delta_net_checkpoints(tmp_path: Path) -> None:
    """Qwen3-Next (three gated-delta-net layers, one attention layer) as vLLM's CPU platform runs
    it: bfloat16 only, attention heads of 32 and delta-net heads of 128 (its kernels refuse
    smaller ones). Its state makes vLLM's block 1,152 tokens, so the prompts are longer: the
    continuation continues from the prompt's checkpoint after 2,304 tokens, from the host tier,
    then in a fresh process from the file tier; the branch (off at 1,500) is computed whole."""
    import transformers

    model = tmp_path / "model"
    preset = MODELS["tiny-qwen3-next"]
    assert preset.llama is not None
    config = getattr(transformers, preset.family)(**preset.llama | {
        "head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(model)
    rng = random.Random(53)
    prompt = [rng.randrange(3, 999) for _ in range(2600)]
    continued = prompt + [rng.randrange(3, 999) for _ in range(200)]
    branch = prompt[:1500] + [rng.randrange(3, 999) for _ in range(900)]
    pages = tmp_path / "pages"

    def spec(with_pages: bool, phases: list[dict[str, Any]]) -> dict[str, Any]:
        out = _spec(model, pages if with_pages else None, phases)
        out |= {"dtype": "bfloat16", "max_model_len": 4096, "kv_cache_bytes": 256 << 20}
        if with_pages:
            out["connector"]["overrides"]["tiers"]["host"]["capacity"] = "64MiB"
        return out

    alone = _outputs(run_engine(tmp_path, "alone", spec(False, _turns([prompt, continued, branch]))))
    cached = run_engine(tmp_path, "hicache", spec(True, [*_turns([prompt, continued, branch]), {"kind": "stats"}]))
    outs = _outputs(cached)
    for got, want in zip(outs, alone):
        _same(got, want)
    assert [o["cached"] for o in outs] == [0, 2304, 0]
    assert cached["phases"][-1]["connector"]["loaded_by_tier"] == {"host": 2304}
    fresh = run_engine(tmp_path, "fresh", spec(True, [*_turns([continued]), {"kind": "stats"}]))
    (out,) = _outputs(fresh)
    _same(out, alone[1])
    assert out["cached"] == 2304 and fresh["phases"][-1]["connector"]["loaded_by_tier"] == {"file": 2304}
