"""The Valkey/Redis tier with a real valkey-server started here: the YAML, two engine processes,
lost keys, a server killed and brought back, and secrets that never show."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hicache import HiCache, load_config

from .conftest import make_config, make_kv, make_tokens
from .servers import ServerProcess, start_valkey

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-Pa55"


@pytest.fixture
def valkey(tmp_path: Path):
    server = start_valkey(tmp_path, password=PASSWORD)
    yield server
    server.stop()


def redis_tier(server: ServerProcess, **extra: object) -> dict:
    return {"kind": "redis", "url": f"redis://127.0.0.1:{server.port}/0", "password": PASSWORD,
            "timeout_s": 2.0, **extra}


def tier_config(server: ServerProcess, device_pages: int = 64, **extra: object):
    return make_config(
        device_pages, 256,
        tiers={"storage": [redis_tier(server, **extra)]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )


async def read_back(cache: HiCache, tokens: list[int], kv: torch.Tensor) -> tuple[int, bool]:
    """Retrieve ``tokens``; the prefix length and whether it equals ``kv`` bit for bit."""
    await cache.lookup(tokens)
    async with cache.retrieve(tokens) as view:
        await view.wait_all()
        exact = all(
            torch.equal(view.layer(layer)[c], kv[c, layer, : view.tokens])
            for layer in range(kv.shape[1]) for c in range(kv.shape[0])
        )
        return view.tokens, exact


async def test_the_issues_yaml_works_with_a_file_tier_above(valkey: ServerProcess, tmp_path: Path) -> None:
    yaml_text = f"""
model: {{name: test-model, num_layers: 4, num_kv_heads: 2, head_dim: 8}}
page_size: 4
tiers:
  device: {{capacity: 64KiB}}
  host: {{capacity: 64KiB}}
  storage:
    - kind: file
      path: {tmp_path / "pages"}
      capacity: 20GiB
    - kind: redis                       # Valkey or Redis
      url: redis://127.0.0.1:{valkey.port}/0
      password: ${{HICACHE_REDIS_PASSWORD}}
      key_prefix: hicache
      ttl_s: 86400
policies: {{prefetch: wait_complete, prefetch_threshold_tokens: 4}}
"""
    path = tmp_path / "hicache.yaml"
    path.write_text(yaml_text)
    config = load_config(path, env={"HICACHE_REDIS_PASSWORD": PASSWORD})
    tokens, kv = make_tokens(24), make_kv(config, 24)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage["redis"].stored_pages == 6
    # Only the remote tier survives: a fresh cache without the file tier finds the pages there.
    remote_only = load_config(path, env={"HICACHE_REDIS_PASSWORD": PASSWORD},
                              overrides={"tiers": {"storage": [config.tiers.storage[1].options | {"kind": "redis"}]}})
    async with HiCache.from_config(remote_only) as cache:
        hit = await cache.lookup(tokens)
        assert hit.by_tier["redis"] == 24
        assert await read_back(cache, tokens, kv) == (24, True)


def spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.remote_worker", *args], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_engine_process_reuses_the_first_ones_kv(valkey: ServerProcess) -> None:
    tier = json.dumps(redis_tier(valkey))
    stored = result(spawn("store", tier, "0", "3"))
    assert stored == {"stored_pages": 18, "skipped_pages": 0, "failures": 0}
    checked = result(spawn("check", tier, "0", "3"))  # computed nothing itself: all from Valkey
    assert checked == {"hits": [24, 24, 24], "exact": [True] * 3, "corrupt": 0, "fetched": 18}


async def test_a_lost_or_expired_key_is_a_miss(valkey: ServerProcess) -> None:
    import redis

    config = tier_config(valkey, ttl_s=1)
    tokens, kv = make_tokens(24, seed=1), make_kv(config, 24, seed=1)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    client = redis.Redis(port=valkey.port, password=PASSWORD)
    names = sorted(client.keys("hicache:*"))
    assert len(names) == 6 and 0 < client.ttl(names[0]) <= 1
    client.delete(names[0])  # one page lost (which one depends on the key): the chain stops there
    async with HiCache.from_config(tier_config(valkey)) as cache:
        hit = (await cache.lookup(tokens)).by_tier["redis"]
        assert hit < 24 and hit % 4 == 0
        assert await read_back(cache, tokens, kv) == (hit, True)
    time.sleep(1.2)  # the server expires the rest
    async with HiCache.from_config(tier_config(valkey)) as cache:
        assert (await cache.lookup(tokens)).by_tier["redis"] == 0
        assert await read_back(cache, tokens, kv) == (0, True)


async def test_a_restarted_server_lost_its_pages_and_is_used_again(valkey: ServerProcess) -> None:
    config = tier_config(valkey, device_pages=64)
    first, kv1 = make_tokens(24, seed=2), make_kv(config, 24, seed=2)
    second, kv2 = make_tokens(24, seed=3), make_kv(config, 24, seed=3)
    async with HiCache.from_config(config) as cache:
        await cache.store(first, kv1)
        await cache.wait_idle()
        valkey.restart()  # no persistence: every key is gone
        await cache.store(second, kv2)
        await cache.wait_idle()
        assert cache.stats().storage["redis"].stored_pages == 12
    async with HiCache.from_config(config) as cache:
        assert (await cache.lookup(first)).by_tier["redis"] == 0
        assert await read_back(cache, second, kv2) == (24, True)


async def test_requests_go_on_while_the_server_is_down_and_it_is_used_again_after(
    valkey: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = tier_config(valkey, device_pages=8)
    prompts = [(make_tokens(24, seed=10 + i), make_kv(config, 24, seed=10 + i)) for i in range(6)]
    async with HiCache.from_config(config) as cache:
        valkey.kill()  # a crash, mid-run
        started = time.monotonic()
        for tokens, kv in prompts[:3]:
            await cache.store(tokens, kv)
            assert await read_back(cache, tokens, kv) == (24, True)  # served from memory
        await cache.wait_idle()
        assert time.monotonic() - started < 10  # bounded by timeout_s, never hung
        stats = cache.stats().storage["redis"]
        assert stats.failures > 0 and stats.stored_pages == 0  # nothing recorded as stored
        valkey.start()  # back on the same port: no restart of the cache
        for tokens, kv in prompts[3:]:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage["redis"].stored_pages == 18
    async with HiCache.from_config(config) as cache:
        for tokens, kv in prompts[3:]:
            assert await read_back(cache, tokens, kv) == (24, True)
        assert (await cache.lookup(prompts[0][0])).by_tier["redis"] == 0  # written while down: a miss
    assert PASSWORD not in caplog.text


async def test_the_password_never_shows(valkey: ServerProcess) -> None:
    config = tier_config(valkey)
    assert PASSWORD not in config.to_yaml() and PASSWORD not in repr(config)
    async with HiCache.from_config(config) as cache:
        await cache.store(make_tokens(8), make_kv(config, 8))
        await cache.wait_idle()
        assert PASSWORD not in repr(cache.stats())
        backend = cache.controller.storage[0].backend
        assert PASSWORD not in repr(backend.settings) and PASSWORD not in repr(backend)


async def test_a_wrong_password_is_a_counted_failure_not_a_crash(valkey: ServerProcess) -> None:
    config = make_config(64, 256, tiers={"storage": [redis_tier(valkey) | {"password": "wrong"}]})
    async with HiCache.from_config(config) as cache:
        tokens, kv = make_tokens(16, seed=5), make_kv(config, 16, seed=5)
        await cache.store(tokens, kv)
        await cache.wait_idle()
        assert await read_back(cache, tokens, kv) == (16, True)
        assert cache.stats().storage["redis"].failures > 0


async def test_clear_removes_only_this_prefix(valkey: ServerProcess) -> None:
    import redis

    from hicache.tiers.storage.redis import RedisBackend

    client = redis.Redis(port=valkey.port, password=PASSWORD)
    client.set("someone-else:data", b"keep me")
    client.set("mine:0123", b"ours")
    async with RedisBackend(url=f"redis://127.0.0.1:{valkey.port}/0", password=PASSWORD, key_prefix="mine") as b:
        await b.clear()
    assert client.get("someone-else:data") == b"keep me" and client.get("mine:0123") is None
