"""``kind: s3`` against a real SeaweedFS S3 gateway (``weed mini``) on loopback, with an IAM identity.

The contract suite runs against it in ``tests/test_storage_backends.py``; here: the YAML with
credentials from the environment, the object names, secrets that never show, wrong credentials
(refused by the server's IAM config), foreign and corrupt objects, two engine processes sharing a
bucket, and the server killed and started again mid-run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache import HiCache, load_config
from hicache.errors import ConfigError
from hicache.tiers.storage.s3 import S3Backend

from .conftest import make_config, make_kv, make_tokens
from .servers import S3_ACCESS_KEY, S3_SECRET_KEY, S3Server, stalled, start_seaweedfs
from .test_storage_backends import PAGE, empty, key, page

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_seaweedfs(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def raw_store(s3: S3Server):
    return s3.raw_store()


def tier_config(tier: dict, device_pages: int = 64):
    return make_config(device_pages, 256, tiers={"storage": [tier]},
                       policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4})


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


async def test_the_yaml_works_and_its_secrets_never_show(
    s3: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "hicache.yaml"
    path.write_text(f"""
model: {{name: test-model, num_layers: 4, num_kv_heads: 2, head_dim: 8}}
page_size: 4
tiers:
  device: {{capacity: 64KiB}}
  host: {{capacity: 64KiB}}
  storage:
    - kind: s3
      endpoint_url: {s3.endpoint_url}
      bucket: {s3.bucket}
      key_prefix: {prefix()}
      access_key_id: ${{HICACHE_S3_ACCESS_KEY_ID}}
      secret_access_key: ${{HICACHE_S3_SECRET_ACCESS_KEY}}
      max_concurrency: 4
      timeout_s: 5
policies: {{prefetch: wait_complete, prefetch_threshold_tokens: 4}}
""")
    env = {"HICACHE_S3_ACCESS_KEY_ID": S3_ACCESS_KEY, "HICACHE_S3_SECRET_ACCESS_KEY": S3_SECRET_KEY}
    config = load_config(path, env=env)
    for text in (config.to_yaml(), repr(config), json.dumps(config.model_dump(mode="json"))):
        assert S3_SECRET_KEY not in text and S3_ACCESS_KEY not in text
    tokens, kv = make_tokens(24, seed=1), make_kv(config, 24, seed=1)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage["s3"].stored_pages == 6
        backend = cache.controller.storage[0].backend
        for text in (repr(cache.stats()), repr(backend.settings), repr(backend)):
            assert S3_SECRET_KEY not in text and S3_ACCESS_KEY not in text
    async with HiCache.from_config(load_config(path, env=env)) as cache:  # a fresh engine: storage only
        assert (await cache.lookup(tokens)).by_tier["s3"] == 24
        assert await read_back(cache, tokens, kv) == (24, True)
    assert S3_SECRET_KEY not in caplog.text


async def test_one_object_per_page_named_by_prefix_shard_and_key(s3: S3Server) -> None:
    import obstore

    p = prefix()
    async with S3Backend(**s3.settings(key_prefix=p)) as b:
        keys = [key(i) for i in range(3)]
        assert await b.set(keys, [page(i) for i in range(3)]) == 3
    listed = sorted((m["path"], m["size"]) for batch in obstore.list(raw_store(s3), prefix=f"{p}/") for m in batch)
    assert listed == sorted((f"{p}/{k.hex()[:2]}/{k.hex()}", PAGE) for k in keys)


async def test_credentials_come_from_the_aws_environment(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = s3.settings(key_prefix=prefix())
    monkeypatch.setenv("AWS_SESSION_TOKEN", "someone-elses-token")  # explicit keys never mix with it
    async with S3Backend(**settings) as b:
        assert await b.set([key(1)], [page(1)]) == 1
    monkeypatch.delenv("AWS_SESSION_TOKEN")
    del settings["access_key_id"], settings["secret_access_key"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    async with S3Backend(**settings) as b:
        assert await b.set([key(0)], [page(0)]) == 1
        assert await b.exists([key(0)]) == 1
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):  # never a lookup of instance metadata
        async with S3Backend(**settings):
            pass


async def test_wrong_credentials_are_a_counted_failure_not_a_crash(s3: S3Server) -> None:
    tier = {"kind": "s3", **s3.settings(key_prefix=prefix(), secret_access_key="not-the-secret")}
    config = tier_config(tier)
    tokens, kv = make_tokens(16, seed=5), make_kv(config, 16, seed=5)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        assert await read_back(cache, tokens, kv) == (16, True)  # served from memory
        stats = cache.stats().storage["s3"]
        assert stats.failures > 0 and stats.stored_pages == 0
        assert stats.backend.errors > 0
    async with HiCache.from_config(tier_config({**tier, "secret_access_key": S3_SECRET_KEY})) as cache:
        assert (await cache.lookup(tokens)).by_tier["s3"] == 0  # the server refused every write


async def test_a_foreign_object_is_a_miss_and_a_corrupt_page_is_dropped(s3: S3Server) -> None:
    import obstore

    p = prefix()
    config = tier_config({"kind": "s3", **s3.settings(key_prefix=p)})
    tokens, kv = make_tokens(8, seed=7), make_kv(config, 8, seed=7)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    store = raw_store(s3)
    names = sorted(m["path"] for batch in obstore.list(store, prefix=f"{p}/") for m in batch)
    assert len(names) == 2
    sizes = {n: obstore.head(store, n)["size"] for n in names}
    # Someone else's object under one page's name: another size, a miss (never read into a page).
    first = names[0]  # the first or the second page of the chain: either way the prompt is not whole
    obstore.put(store, first, b"not a page")
    async with HiCache.from_config(config) as cache:
        n, exact = await read_back(cache, tokens, kv)
        assert exact and n < 8
        assert cache.stats().storage["s3"].backend.corrupt_pages == 0  # a size mismatch never reaches the codec
    # The right size, the wrong bytes: verification fails, the page is a miss, counted and removed.
    obstore.put(store, first, os.urandom(sizes[first]))
    async with HiCache.from_config(config) as cache:
        n, exact = await read_back(cache, tokens, kv)
        assert exact and n < 8
        assert cache.stats().storage["s3"].backend.corrupt_pages == 1
    with pytest.raises(FileNotFoundError):
        obstore.head(store, first)


def spawn(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen([sys.executable, "-m", "tests.remote_worker", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_engine_process_reuses_the_first_ones_kv(s3: S3Server) -> None:
    """Two processes, one bucket; the credentials reach both through the standard AWS variables only."""
    tier = {"kind": "s3", "endpoint_url": s3.endpoint_url, "bucket": s3.bucket, "key_prefix": prefix(), "timeout_s": 5}
    env = {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY, "AWS_SESSION_TOKEN": ""}
    assert result(spawn(env, "store", json.dumps(tier), "0", "3")) == {"stored_pages": 18, "skipped_pages": 0,
                                                                       "failures": 0}
    checked = result(spawn(env, "check", json.dumps(tier), "0", "3"))  # computed nothing itself
    assert checked == {"hits": [24, 24, 24], "exact": [True] * 3, "corrupt": 0, "fetched": 18}


async def test_the_server_killed_mid_run_then_back(s3: S3Server) -> None:
    config = tier_config({"kind": "s3", **s3.settings(key_prefix=prefix(), timeout_s=2.0)}, device_pages=8)
    prompts = [(make_tokens(24, seed=20 + i), make_kv(config, 24, seed=20 + i)) for i in range(6)]
    async with HiCache.from_config(config) as cache:
        await cache.store(*prompts[0])
        await cache.wait_idle()
        s3.kill()  # a crash, mid-run
        try:
            started = time.monotonic()
            for tokens, kv in prompts[1:3]:
                await cache.store(tokens, kv)
                assert await read_back(cache, tokens, kv) == (24, True)  # served from memory
            await cache.wait_idle()
            assert time.monotonic() - started < 15  # bounded by timeout_s, never hung
            stats = cache.stats().storage["s3"]
            assert stats.failures > 0 and stats.stored_pages == 6  # nothing more recorded as stored
        finally:
            s3.start()  # same ports, same folder: no restart of the cache
        for tokens, kv in prompts[3:]:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage["s3"].stored_pages == 6 + 18
    async with HiCache.from_config(config) as cache:
        for tokens, kv in prompts[3:]:
            assert await read_back(cache, tokens, kv) == (24, True)
        for tokens, _ in prompts[1:3]:  # written while it was down: misses
            assert (await cache.lookup(tokens)).by_tier["s3"] == 0


async def test_a_stalled_server_costs_timeout_s_per_call_not_a_hang(s3: S3Server) -> None:
    """SIGSTOP: connections are accepted by the kernel but nothing answers, as a hung gateway would."""
    from hicache.errors import StorageTimeoutError

    async with S3Backend(**s3.settings(key_prefix=prefix(), timeout_s=1.0)) as b:
        assert await b.set([key(0)], [page(0)]) == 1
        assert s3.process.proc is not None
        with stalled(s3.process.proc.pid):
            started = time.monotonic()
            with pytest.raises(StorageTimeoutError):
                await b.get([key(0)], empty(1))
            with pytest.raises(StorageTimeoutError):
                await b.set([key(1)], [page(1)])
            assert time.monotonic() - started < 4
        assert b.stats().timeouts == 2
        deadline = time.monotonic() + 10
        while True:  # used again once it answers
            try:
                assert await b.exists([key(0)]) == 1
                break
            except StorageTimeoutError:
                assert time.monotonic() < deadline
