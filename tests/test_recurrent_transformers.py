"""Recurrent hybrids through the transformers integration (random LFM2, Qwen3-Next and Granite 4):
a hit continues from a checkpoint of every recurrent layer's state, from every tier and in a fresh
process, and gives the answers of the model without a cache; a checkpoint that is missing, damaged
or of another layout makes the hit shorter, never the answer different."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from hicache import ConfigError, HiCache, InvalidRequestError, load_config
from hicache.bench.models import load_model
from hicache.containers import namespace_from_config
from hicache.integrations.transformers import CachedCausalLM, ModelSpec
from hicache.keys import as_token_bytes, chain_keys
from hicache.layer_kinds import LayerKinds

from .helpers import assert_consistent
from .lm_helpers import PAGE, full_prefill_logits, greedy, lm_config, prompt, run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

FAMILIES = ["tiny-lfm2", "tiny-qwen3-next", "tiny-granite4"]
MODELS = {name: load_model(name) for name in FAMILIES}
LFM2 = MODELS["tiny-lfm2"]


def interval(tokens: int) -> dict[str, Any]:
    return {"policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": PAGE,
                         "checkpoint_interval_tokens": tokens}}


def test_the_layout_names_each_recurrent_layers_state_and_separates_namespaces() -> None:
    spec = ModelSpec.of(MODELS["tiny-qwen3-next"])
    assert spec.layers.canonical() == "recurrent:conv0=128x4/float32+rec0=4x16x16/float32*3,full"
    assert spec.layers.recurrent == (0, 1, 2) and spec.layers.full == (3,)
    config = lm_config(MODELS["tiny-qwen3-next"], None)
    # 6,144 bytes of state a layer, 4,096 bytes a layer of a page: two state layers each
    assert spec.layers[0].state_bytes == 6144 and config.slot_bytes == 4096
    assert config.num_cache_layers == 7 and config.cache_layers.partial == (0, 1, 2, 3, 4, 5)
    lfm2 = lm_config(LFM2, None)
    other = [
        lfm2.model.model_copy(update={"layers": LayerKinds.parse(["recurrent:conv0=64x4/float32"] + list(lfm2.model.layers)[1:])}),
        lfm2.model.model_copy(update={"layers": LayerKinds.parse(["full"] + list(lfm2.model.layers)[1:])}),
    ]
    digests = {namespace_from_config(lfm2).digest} | {
        namespace_from_config(lfm2.model_copy(update={"model": m})).digest for m in other
    }
    assert len(digests) == 3, "a checkpoint of one state layout must never be served to another"


def test_what_cannot_hold_checkpoints_is_refused_with_the_reason(tmp_path: Path) -> None:
    whole = lm_config(LFM2, None, tiers={"storage": [{"kind": "file", "path": str(tmp_path), "split_layers": False}]})
    with pytest.raises(ConfigError, match="layer-split"):
        HiCache.from_config(whole)
    lossy = lm_config(LFM2, None, tiers={"storage": [{"kind": "file", "path": str(tmp_path), "codec": ["int8"]}]})
    with pytest.raises(ConfigError, match="lossy"):
        HiCache.from_config(lossy)
    with pytest.raises(ValueError, match="sliding-window and recurrent"):
        LayerKinds.parse(["sliding:8", "recurrent:s=4/float32", "full"])


async def test_a_store_names_its_checkpoints_on_page_ends() -> None:
    config = lm_config(LFM2, None)
    kv = torch.zeros((2, config.num_cache_layers, 64, 2, 16))
    async with HiCache.from_config(config) as cache:
        with pytest.raises(InvalidRequestError, match="multiple of page_size"):
            await cache.store(list(range(64)), kv, checkpoints=[20])
        with pytest.raises(InvalidRequestError, match="multiple of page_size"):
            await cache.store(list(range(64)), kv, checkpoints=[80])
        # no checkpoint: every page thin, so no hit ends anywhere in them
        await cache.store(list(range(64)), kv)
        assert (await cache.lookup(list(range(64)) + [1])).tokens == 0
        await cache.wait_idle()  # a page being copied between tiers is not filled (best effort)
        # a later store of the same prefix fills the checkpoints it has, inside a node too
        await cache.store(list(range(64)), kv, checkpoints=[32])
        assert (await cache.lookup(list(range(64)) + [1])).tokens == 32
    llama = lm_config(load_model("tiny"), None)
    async with HiCache.from_config(llama) as cache:
        with pytest.raises(InvalidRequestError, match="recurrent"):
            await cache.store(list(range(16)), torch.zeros((2, 2, 16, 2, 16)), checkpoints=[16])


@pytest.mark.parametrize("family", FAMILIES)
async def test_greedy_answers_over_a_multi_turn_chat_match_from_every_tier_and_a_fresh_process(
    tmp_path: Path, family: str
) -> None:
    """Two chats interleaved over a device and a host too small for both: turns restore from the
    device, the host and the file tier, and every answer is the model's own; then another process,
    with only the folder, continues the last turn from the file tier's checkpoints."""
    model = MODELS[family]
    config = lm_config(model, tmp_path / "pages", device_pages=10, host_pages=12, **interval(64))
    chats = {c: [prompt(40, seed=10 * c + t) for t in range(3)] for c in (1, 2)}
    answers: dict[str, list[list[int]]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    by_tier: dict[str, int] = {"device": 0, "host": 0, "file": 0}
    histories: dict[int, list[int]] = {}
    for name in ("none", "cache"):
        answers[name], logits[name] = [], []
        histories = {1: [], 2: []}
        async with HiCache.from_config(config) as cache:
            lm = CachedCausalLM(model, cache if name == "cache" else None)
            for t in range(3):
                for c in (1, 2):
                    histories[c] += chats[c][t]
                    out, seq = await run(lm, histories[c], new_tokens=5)
                    answers[name].append(out)
                    logits[name].append(seq.logits)  # the last step's: greedy tokens alone can hide a wrong state
                    histories[c] += out
                    await cache.wait_idle()
                    if name == "cache":
                        for tier, n in seq.by_tier.items():
                            by_tier[tier] += n
            if name == "cache":
                assert_consistent(cache)
    assert answers["none"] == answers["cache"]
    for a, b in zip(logits["none"], logits["cache"]):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert answers["none"][0] == greedy(model, chats[1][0], 6)
    assert min(by_tier.values()) > 0, by_tier  # hits from every tier
    script = (
        "import asyncio, json, sys\n"
        "from hicache import HiCache, load_config\n"
        "from hicache.bench.models import load_model\n"
        "from hicache.integrations.transformers import CachedCausalLM\n"
        "async def main():\n"
        "    config = load_config(overrides=json.loads(sys.argv[1]), env={})\n"
        "    async with HiCache.from_config(config) as cache:\n"
        "        lm = CachedCausalLM(load_model(sys.argv[2]), cache)\n"
        "        tokens = json.loads(sys.argv[3])\n"
        "        await lm.lookup(tokens)\n"
        "        async with lm.sequence(tokens) as seq:\n"
        "            out = [await seq.prefill()]\n"
        "            for _ in range(3):\n"
        "                out.append(await seq.decode(out[-1]))\n"
        "        print(json.dumps({'out': out, 'by_tier': dict(seq.by_tier), 'logits': seq.logits.tolist()}))\n"
        "asyncio.run(main())\n"
    )
    tokens = histories[1] + prompt(10, seed=99)
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(config.model_dump(mode="json")), family, json.dumps(tokens)],
        capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["by_tier"]["file"] > 0, got
    assert got["out"] == greedy(model, tokens, 4)
    want = full_prefill_logits(model, tokens + got["out"][:-1])
    assert torch.allclose(torch.tensor(got["logits"]), want, atol=1e-5)


async def test_checkpoints_every_interval_let_a_prompt_branch_off_mid_prefix(tmp_path: Path) -> None:
    """A prompt that shares 150 tokens of a stored 200-token one continues from the last checkpoint
    before it branches off: at 128 tokens with one every 64, at none with checkpoints at ends only."""
    stored, branch = prompt(200, seed=1), prompt(200, seed=1)[:150] + prompt(30, seed=2)
    for every, hit in ((64, 128), (0, 0)):
        async with HiCache.from_config(lm_config(LFM2, None, **interval(every))) as cache:
            lm = CachedCausalLM(LFM2, cache)
            await run(lm, stored)
            _, seq = await run(lm, branch)
            assert seq.cached_tokens == hit, (every, seq.cached_tokens)
            assert torch.allclose(seq.logits, full_prefill_logits(LFM2, branch), atol=1e-5)


def _state_part(cache: HiCache, tokens: list[int], page: int) -> Path:
    """The file holding the state layers of page ``page`` of ``tokens`` in the cache's file tier."""
    tier = cache.controller.storage[0]
    key = chain_keys(cache.controller.tree.seed, as_token_bytes(tokens), PAGE)[page]
    part = tier.sliding_part  # type: ignore[attr-defined]
    return tier.backend.path_of(part.codec.storage_keys([key])[0])


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted", "foreign"])
async def test_a_damaged_checkpoint_makes_the_hit_shorter_never_the_answer_different(
    tmp_path: Path, damage: str
) -> None:
    """The 200-token prompt's last checkpoint (after 192 tokens) is damaged in the file tier; a fresh
    cache continues from the one before (after 128) and answers as the model does."""
    tokens = prompt(200, seed=20)
    config = lm_config(LFM2, tmp_path / "pages", **interval(64))
    async with HiCache.from_config(config) as cache:
        await run(CachedCausalLM(LFM2, cache), tokens)
        await cache.wait_idle()
        victim = _state_part(cache, tokens, 192 // PAGE - 1)
        earlier = _state_part(cache, tokens, 128 // PAGE - 1)
    assert victim.is_file() and earlier.is_file()
    raw = bytearray(victim.read_bytes())
    if damage == "flipped":
        raw[128 + 7] ^= 0x01  # after the 128-byte header: the first recurrent layer's state
        victim.write_bytes(bytes(raw))
    elif damage == "truncated":
        victim.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "deleted":
        victim.unlink()
    else:  # an earlier checkpoint's bytes under this one's name: a state of another position
        victim.write_bytes(earlier.read_bytes())
    asked = tokens + [5]
    async with HiCache.from_config(config) as cache:
        out, seq = await run(CachedCausalLM(LFM2, cache), asked, new_tokens=3)
        corrupt = cache.stats().storage["file"].backend.corrupt_pages
    # the checkpoint before it (after 128 tokens) is read back whole: the hit ends there
    want = {"flipped": (128, 1), "truncated": (128, 1), "deleted": (128, 0), "foreign": (128, 1)}[damage]
    assert (seq.cached_tokens, corrupt) == want, (seq.cached_tokens, corrupt)
    assert out == greedy(LFM2, asked, 4)
    assert torch.allclose(seq.logits, full_prefill_logits(LFM2, asked + out[:-1]), atol=1e-5)


async def test_inspect_lists_checkpoints_as_a_part_of_their_own_and_finds_a_flipped_one(tmp_path: Path) -> None:
    from hicache.containers import inspection_target
    from hicache.inspect import summarize, verify

    tokens = prompt(200, seed=30)
    config = lm_config(LFM2, tmp_path / "pages", **interval(64))
    async with HiCache.from_config(config) as cache:
        await run(CachedCausalLM(LFM2, cache), tokens)
        await cache.wait_idle()
        victim = _state_part(cache, tokens, 128 // PAGE - 1)
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 4
    victim.write_bytes(bytes(raw))
    _, backend, codec = inspection_target(config)
    assert isinstance(codec, tuple) and [c.part for c in codec] == ["layers:full", "layers:state"]
    async with backend:
        summary = await summarize(backend, codec, config, "file", quiet=True)
        labels = {g.label: g.pages for g in summary.groups}
        name = f"{config.model.name} rev {config.model.revision}"
        # 12 pages; checkpoints after 64, 128 and 192 tokens (192: the prompt's last page end)
        assert labels == {f"this config ({name}), full layers": 12,
                          f"this config ({name}), checkpoint (recurrent state) layers": 3}, labels
        report = await verify(backend, codec, "file", quiet=True)
        assert report.ok == report.ours == 14 and [c.reason for c in report.corrupt] == ["checksum"]


async def test_a_prefetch_cancelled_while_it_looks_for_checkpoints_keeps_no_host_page(tmp_path: Path) -> None:
    """The read-back probes each page's checkpoint before reading (one call a page, each slowed
    here): cancelling it there gives back every host page it had taken."""
    from hicache.controller.prefetch import Prefetcher

    tokens = prompt(200, seed=40)
    config = lm_config(LFM2, tmp_path / "pages", **interval(64))
    async with HiCache.from_config(config) as cache:
        await run(CachedCausalLM(LFM2, cache), tokens)
        await cache.wait_idle()
    raw = config.model_dump(mode="json")
    raw["tiers"]["storage"] = [{"kind": "tests.fakes:DelayingStorageBackend", "name": "file", "delay_s": 0.05,
                                "inner": {"kind": "file", "path": str(tmp_path / "pages")}}]
    slow = load_config(overrides=raw, env={})
    async with HiCache.from_config(slow) as cache:
        probed = anyio.Event()
        probe = Prefetcher._checkpoints_in

        async def watched(*args: Any) -> list[int]:
            probed.set()
            return await probe(*args)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Prefetcher, "_checkpoints_in", staticmethod(watched))
            hit = await cache.lookup(tokens + [1])
            assert hit.prefetch is not None
            await probed.wait()
            hit.prefetch.cancel()
            await cache.wait_idle()
        assert_consistent(cache)
        assert cache.stats().tiers["host"].used_pages == 0, cache.stats().tiers["host"]
