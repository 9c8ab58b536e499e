"""Bad input gets a typed error that says what was expected, and leaves the cache unchanged."""

from __future__ import annotations

import pytest
import torch

from hicache import CacheClosedError, HiCache, InvalidKVError, InvalidRequestError, InvalidTokensError

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, -3, 4], "non-negative"),
        ([1.5, 2, 3, 4], "integers"),
        (["a", "b"], "integers"),
        ([[1, 2], [3, 4]], "integers"),
        ("1234", "sequence of ints"),
        (42, "sequence of ints"),
        (None, "sequence of ints"),
        (torch.tensor([1.0, 2.0]), "integers"),
        (torch.tensor([[1, 2], [3, 4]]), "1-D"),
        (torch.tensor([1, -2]), "non-negative"),
        ([2**70], "integers"),
    ],
)
async def test_bad_token_ids_are_rejected(tokens: object, message: str) -> None:
    config = make_config()
    async with HiCache.from_config(config) as cache:
        with pytest.raises(InvalidTokensError, match=message):
            await cache.lookup(tokens)
        with pytest.raises(InvalidTokensError, match=message):
            await cache.store(tokens, make_kv(config, 4))
        with pytest.raises(InvalidTokensError, match=message):
            cache.retrieve(tokens)
        assert cache.stats().stores == 0


async def test_token_tensors_are_accepted() -> None:
    config = make_config()
    tokens = make_tokens(8)
    async with HiCache.from_config(config) as cache:
        await cache.store(torch.tensor(tokens, dtype=torch.int32), make_kv(config, 8))
        assert (await cache.lookup(tokens)).tokens == 8


@pytest.mark.parametrize(
    ("make_bad", "message"),
    [
        (lambda cfg: make_kv(cfg, 8).to(torch.float64), "dtype must be torch.float32"),
        (lambda cfg: make_kv(cfg, 8)[:, :3], r"shape must be .*\[2, 4, 8, 2, 8\]"),
        (lambda cfg: make_kv(cfg, 8)[..., :4], r"shape must be"),
        (lambda cfg: make_kv(cfg, 8)[:1], r"shape must be"),
        (lambda cfg: make_kv(cfg, 12), "holds 12 tokens but 8 token ids"),
        (lambda cfg: make_kv(cfg, 8).tolist(), "must be a torch.Tensor"),
    ],
)
async def test_bad_kv_is_rejected_and_cache_unchanged(make_bad, message: str) -> None:
    config = make_config()
    tokens = make_tokens(8)
    async with HiCache.from_config(config) as cache:
        await cache.store(make_tokens(8, seed=7), make_kv(config, 8))
        await cache.wait_idle()
        before = (cache.controller.device.used_pages, cache.controller.host.used_pages, cache.stats().stored_pages)
        with pytest.raises(InvalidKVError, match=message):
            await cache.store(tokens, make_bad(config))
        after = (cache.controller.device.used_pages, cache.controller.host.used_pages, cache.stats().stored_pages)
        assert before == after
        assert (await cache.lookup(tokens)).tokens == 0
        assert_consistent(cache)


async def test_errors_share_one_base() -> None:
    assert issubclass(InvalidTokensError, InvalidRequestError)
    assert issubclass(InvalidKVError, InvalidRequestError)


async def test_closed_cache_raises() -> None:
    cache = HiCache.from_config(make_config())
    with pytest.raises(CacheClosedError):
        await cache.lookup([1, 2, 3, 4])
    async with cache:
        pass
    with pytest.raises(CacheClosedError):
        await cache.store([1, 2, 3, 4], make_kv(make_config(), 4))


async def test_view_misuse_is_reported() -> None:
    config = make_config()
    tokens = make_tokens(8)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, make_kv(config, 8))
        async with cache.retrieve(tokens) as view:
            with pytest.raises(InvalidRequestError, match="layer must be in"):
                await view.wait_layer(4)
        with pytest.raises(InvalidRequestError, match="released"):
            view.layer(0)
        with pytest.raises(InvalidRequestError, match="num_pages"):
            cache.reserve(-1)


async def test_a_closed_cache_cannot_be_reopened() -> None:
    cache = HiCache.from_config(make_config())
    async with cache:
        await cache.store(make_tokens(8), make_kv(make_config(), 8))
    with pytest.raises(CacheClosedError, match="entered once"):
        async with cache:
            pass
