"""A node larger than the free room in the tier below still leaves, by runs (issue 19, point 1).

Device 9 pages, host 2: one 7-page prompt is one radix node, more than the host holds. Pages move
between tiers in runs that fit (the node is split), so an idle cache (nothing leased, nothing in
flight) can always make room, and under write-through every page still reaches storage: a run is
copied to the host, written, dropped from the host, then the next run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hicache import HiCache
from hicache.keys import as_token_bytes, chain_keys

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent

PAGE = 4
DEVICE = 9
HOST = 2
PROMPT_PAGES = 7


def _config(host: int, tmp_path: Path | None, write: str = "write_through"):
    tiers = {}
    if tmp_path is not None:
        tiers["storage"] = [{"kind": "file", "name": "file", "path": str(tmp_path / "pages"), "fsync": "never"}]
    return make_config(DEVICE, host, tiers=tiers, policies={"write": write},
                       controller={"shutdown_timeout_s": 30})


async def _commit_prompt(cache: HiCache, seed: int) -> list[int]:
    tokens = make_tokens(PROMPT_PAGES * PAGE, seed)
    async with cache.reserve(PROMPT_PAGES) as res:
        cache.device_kv[:, :, list(res.pages)] = float(seed)
        assert await res.commit(tokens) == PROMPT_PAGES * PAGE
    return tokens


def _files(tmp_path: Path) -> int:
    return sum(1 for _ in (tmp_path / "pages").glob("*/*.kv"))


@pytest.mark.parametrize("storage", [False, True], ids=["no-storage", "file"])
@pytest.mark.parametrize("write", ["write_through", "write_back"])
async def test_an_idle_cache_reserves_again_when_the_host_is_smaller_than_a_node(
    tmp_path: Path, storage: bool, write: str
) -> None:
    """The issue's scenario: ``reserve(7)`` + ``commit``, ``wait_idle()``, ``reserve(7)`` again (it raised
    ``CapacityError: 7 pages requested, 2 free``); then the whole device, twice."""
    async with HiCache.from_config(_config(HOST, tmp_path if storage else None, write)) as cache:
        await _commit_prompt(cache, 1)
        await cache.wait_idle()
        async with cache.reserve(PROMPT_PAGES) as res:
            assert len(res.pages) == PROMPT_PAGES
        await _commit_prompt(cache, 2)
        await cache.wait_idle()
        for _ in range(2):
            async with cache.reserve(DEVICE) as res:  # nothing leased, nothing in flight: all of it
                assert len(res.pages) == DEVICE
        await cache.wait_idle()
        assert_consistent(cache)
        assert cache.stats().lost_pages == 0


async def test_write_through_delivers_every_page_of_a_node_larger_than_the_host(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under write-through the 7 pages reach the file tier while the cache runs, not only at exit (where
    they used to be counted lost: "closed with 7 pages ... not written there")."""
    async with HiCache.from_config(_config(HOST, tmp_path)) as cache:
        tokens = await _commit_prompt(cache, 3)
        await cache.wait_idle()
        assert _files(tmp_path) == PROMPT_PAGES, "write-through stopped short of storage"
        assert cache.stats().lost_pages == 0
        assert cache.stats().backups_skipped == 0
        keys = chain_keys(cache.controller.tree.seed, as_token_bytes(tokens), PAGE)
        tier = cache.controller.storage[0]
        assert await tier.exists(keys) == PROMPT_PAGES
        assert_consistent(cache)
    assert cache.stats().lost_pages == 0
    assert "not written there" not in caplog.text


async def test_a_retrieve_after_the_node_left_the_device_is_bit_exact(tmp_path: Path) -> None:
    """The node left the device by runs (split on the way); what comes back is what was stored."""
    config = _config(8, tmp_path)
    kv = make_kv(config, PROMPT_PAGES * PAGE, seed=5)
    tokens = make_tokens(PROMPT_PAGES * PAGE, 5)
    async with HiCache.from_config(_config(HOST, tmp_path)) as cache:
        assert (await cache.store(tokens, kv)).stored_tokens == PROMPT_PAGES * PAGE
        await cache.wait_idle()
        async with cache.reserve(DEVICE) as res:  # the whole device: the prompt left it entirely
            assert len(res.pages) == DEVICE
        assert cache.controller.device.used_pages == 0
    # A second cache with room for the whole prompt reads it back from the file tier.
    async with HiCache.from_config(config) as second:
        async with second.retrieve(tokens) as view:
            assert view.tokens == PROMPT_PAGES * PAGE
            for layer in range(config.model.num_layers):
                await view.wait_layer(layer)
                for c, part in enumerate(view.layer(layer)):
                    assert part.equal(kv[c, layer]), f"layer {layer} component {c}: wrong KV"


async def test_an_eight_page_host_still_works(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The control case of the issue: a host that holds the node (it always worked)."""
    caplog.set_level(logging.WARNING)
    async with HiCache.from_config(_config(8, tmp_path)) as cache:
        await _commit_prompt(cache, 4)
        await cache.wait_idle()
        async with cache.reserve(PROMPT_PAGES) as res:
            assert len(res.pages) == PROMPT_PAGES
        assert _files(tmp_path) == PROMPT_PAGES
    assert cache.stats().lost_pages == 0
    assert "not written there" not in caplog.text


@pytest.mark.parametrize("prefetch", ["wait_complete", "timeout"])
async def test_a_retrieve_through_a_host_smaller_than_the_prefix_keeps_lookups_word(tmp_path: Path, prefetch: str) -> None:
    """The prompt is only in storage; the host holds 2 of its 7 pages. The retrieve brings it up run
    by run (prefetch a run to the host, load it to the device, its host pages go, the next run), so
    it serves what ``lookup`` promised (it served 2 pages and said nothing: no short retrieve)."""
    config = make_config(DEVICE, HOST, tiers={"storage": [
        {"kind": "file", "name": "file", "path": str(tmp_path / "pages"), "fsync": "never"}]},
        policies={"write": "write_through", "prefetch": prefetch, "prefetch_threshold_tokens": 0})
    kv = make_kv(config, PROMPT_PAGES * PAGE, seed=6)
    tokens = make_tokens(PROMPT_PAGES * PAGE, 6)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        async with cache.reserve(DEVICE):  # the prompt leaves memory: only the file tier has it
            pass
        assert not list(cache.controller.tree.nodes())
        hit = await cache.lookup(tokens)
        assert hit.tokens == PROMPT_PAGES * PAGE and hit.by_tier["file"] == hit.tokens
        async with cache.retrieve(tokens) as view:
            assert view.tokens == hit.tokens, dict(view.by_tier)
            assert view.by_tier["file"] == hit.tokens
            for layer in range(config.model.num_layers):
                await view.wait_layer(layer)
                for c, part in enumerate(view.layer(layer)):
                    assert part.equal(kv[c, layer]), f"layer {layer} component {c}: wrong KV"
        await cache.wait_idle()
        assert cache.stats().short_retrieves == 0
        assert_consistent(cache)


async def test_queued_prefetches_do_not_starve_a_retrieve_through_a_two_page_host(tmp_path: Path) -> None:
    """An engine's queue: four prompts looked up at once (each lookup starts a prefetch into the
    2-page host), then served one by one. Each retrieve gets its whole prompt from the file tier:
    a prefetch never pins the host's last page (it is the device's way down), and a retrieve goes
    on once pins are released (the first one served 1 page of 7)."""
    config = make_config(DEVICE, HOST, tiers={"storage": [
        {"kind": "file", "name": "file", "path": str(tmp_path / "pages"), "fsync": "never"}]},
        policies={"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0})
    prompts = [make_tokens(PROMPT_PAGES * PAGE + 1, 10 + i) for i in range(4)]
    async with HiCache.from_config(config) as cache:
        for tokens in prompts:
            async with cache.reserve(PROMPT_PAGES) as res:
                await res.commit(tokens)
        await cache.wait_idle()
        async with cache.reserve(DEVICE):
            pass
        hits = [await cache.lookup(tokens) for tokens in prompts]
        assert [h.tokens for h in hits] == [PROMPT_PAGES * PAGE] * 4
        for tokens, hit in zip(prompts, hits, strict=True):
            async with cache.retrieve(tokens) as view:
                assert view.tokens == hit.tokens, dict(view.by_tier)
        await cache.wait_idle()
        assert cache.stats().short_retrieves == 0
        assert_consistent(cache)
