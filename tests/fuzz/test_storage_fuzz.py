"""Fuzzing what a shared store may hold under a prompt's names (issue 11, the fuzz suite).

For each backend (a folder, a real valkey-server, a real mooncake_master), with and without a tenant
key, a prompt of four pages is stored, pushed out of memory, and each of its pages is replaced by
something drawn at random: a truncated, extended, bit-flipped or random value, a bare header,
another prompt's valid page (a replay), a valid page of another tenant or namespace, a forged page
(genuine header fields, the forger's own payload and check value; with a key only: without one the
checksum protects integrity, not authenticity), and in the folder a FIFO, a link out of the folder,
a link loop, a socket or a folder.

The property: retrieving the prompt never raises, never hangs (each step bounded), and serves,
bit for bit, the right KV for a prefix at least as long as the untouched leading pages; the index
stays exact (no page leaked) and, for the folder, no descriptor leaks; the victim's later stores
repair whatever can be repaired (everything but a folder planted in a page's place).
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache import HiCache, HiCacheConfig
from hicache.tiers.storage import HEADER_BYTES

from ..conftest import make_config, make_kv, make_tokens
from ..helpers import assert_consistent, push_to_storage
from ..hostile import KEY_A, KEY_B, Attacker, codec_of, open_fds, read_back, storage_names, tier_entry
from ..mooncake_master import start_mooncake
from ..servers import ServerProcess, start_valkey
from .conftest import examples

PAGES, PAGE_SIZE = 4, 4
COMMON = ["keep", "truncate", "extend", "flip", "random", "header-only", "replay", "other-tenant"]
KEYED_ONLY = ["forged"]
FOLDER_ONLY = ["fifo", "link-out", "link-loop", "socket", "folder"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[dict]:
    """Servers are started lazily, once per module, by the backend that needs them."""
    started: dict = {"tmp": tmp_path_factory.mktemp("fuzz-stores")}
    yield started
    for server in started.get("servers", []):
        server.stop()


def entry_for(kind: str, stores: dict) -> dict:
    if kind == "redis":
        if "valkey" not in stores:
            server: ServerProcess = start_valkey(stores["tmp"])
            stores.setdefault("servers", []).append(server)
            stores["valkey"] = server.port
        return tier_entry("redis", tmp_path=stores["tmp"], valkey_port=stores["valkey"])
    if kind == "mooncake":
        if "mooncake" not in stores:
            server, settings = start_mooncake(stores["tmp"])
            stores.setdefault("servers", []).append(server)
            stores["mooncake"] = settings
        return tier_entry("mooncake", tmp_path=stores["tmp"], mooncake=stores["mooncake"])
    return tier_entry("file", tmp_path=Path(tempfile.mkdtemp(dir=stores["tmp"])))


def tenant(entry: dict, key: str | None, **extra: object) -> HiCacheConfig:
    return make_config(
        8, 16, tiers={"storage": [entry]}, policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
        **({"tenant_key": key} if key else {}), **extra,
    )


async def plant(kind: str, r: int, i: int, ctx: dict) -> None:
    """Replace page ``i`` of the victim's prompt by a value of ``kind`` (``r``: the random parameter)."""
    attacker: Attacker = ctx["attacker"]
    name, genuine = ctx["names"][i], ctx["originals"][i]
    rng = np.random.default_rng(r)
    if kind == "keep":
        return
    if kind == "truncate":
        await attacker.write_raw(name, genuine[: r % len(genuine)])
    elif kind == "extend":
        await attacker.write_raw(name, genuine + rng.bytes(1 + r % 64))
    elif kind == "flip":
        value = bytearray(genuine)
        value[r % len(value)] ^= 1 << (r % 8)
        await attacker.write_raw(name, bytes(value))
    elif kind == "random":
        await attacker.write_raw(name, rng.bytes(len(genuine)))
    elif kind == "header-only":
        await attacker.write_raw(name, genuine[:HEADER_BYTES])
    elif kind == "replay":
        await attacker.write_raw(name, ctx["replays"][r % len(ctx["replays"])])
    elif kind == "other-tenant":
        other = ctx["others"][r % len(ctx["others"])]
        header = np.zeros(HEADER_BYTES, np.uint8)
        payload = np.frombuffer(genuine[HEADER_BYTES:], np.uint8).copy()  # the same KV, under another tenant
        other.encode(name, [memoryview(payload)], memoryview(header))
        await attacker.write_raw(name, header.tobytes() + payload.tobytes())
    elif kind == "forged":
        forger = ctx["others"][r % len(ctx["others"])]
        payload = np.frombuffer(rng.bytes(len(genuine) - HEADER_BYTES), np.uint8).copy()
        header = np.frombuffer(genuine[:HEADER_BYTES], np.uint8).copy()
        check = np.zeros(HEADER_BYTES, np.uint8)
        forger.encode(name, [memoryview(payload)], memoryview(check))
        header[96:] = check[96:]  # the genuine fields, the forger's check value
        await attacker.write_raw(name, header.tobytes() + payload.tobytes())
    else:  # the folder's own hazards
        path: Path = attacker.backend.path_of(name)  # type: ignore[attr-defined]
        path.unlink(missing_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "link-out":
            outside = ctx["outside"] / name.hex()
            outside.write_bytes(genuine)
            path.symlink_to(outside)
        elif kind == "link-loop":
            path.symlink_to(path.name)
        elif kind == "socket":  # bound in a short folder (AF_UNIX paths are short), then moved in place
            short = Path(tempfile.mkdtemp(prefix="hs-", dir="/tmp"))
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.bind(str(short / "s"))
                os.rename(short / "s", path)
            finally:
                os.rmdir(short)
        elif kind == "folder":
            path.mkdir()


async def run_example(entry: dict, keyed: bool, mutations: list[tuple[str, int]]) -> None:
    config = tenant(entry, KEY_A if keyed else None)
    tokens, kv = make_tokens(PAGES * PAGE_SIZE, seed=21), make_kv(config, PAGES * PAGE_SIZE, seed=21)
    other_tokens, other_kv = make_tokens(PAGES * PAGE_SIZE, seed=22), make_kv(config, PAGES * PAGE_SIZE, seed=22)
    others = [codec_of(tenant(entry, None, tenant_salt="another-tenant")), codec_of(tenant(entry, KEY_B))]
    if keyed:
        others.append(codec_of(tenant(entry, None)))  # the same namespace without a key
    fds = open_fds()
    async with HiCache.from_config(config) as cache, Attacker(entry, config.page_bytes) as attacker:
        await cache.store(tokens, kv)
        await cache.store(other_tokens, other_kv)
        await push_to_storage(cache)
        names = storage_names(config, tokens)
        ctx = {
            "attacker": attacker, "names": names, "others": others,
            "originals": [await attacker.read(n) for n in names],
            "replays": [await attacker.read(n) for n in storage_names(config, other_tokens)],
            "outside": Path(tempfile.mkdtemp(dir=Path(entry["path"]).parent)) if "path" in entry else None,
        }
        for i, (kind, r) in enumerate(mutations):
            await plant(kind, r, i, ctx)
        untouched = next((i for i, (kind, _) in enumerate(mutations) if kind != "keep"), PAGES)
        with anyio.fail_after(60):
            served = await read_back(cache, tokens, kv)  # bit for bit, or the test fails
        assert served >= untouched * PAGE_SIZE
        # The victim goes on storing the prompt: what was planted is dropped as it is met, and
        # the real pages take its place (a folder in a page's place is the one thing that stays).
        for _ in range(PAGES + 1):
            if served == PAGES * PAGE_SIZE:
                break
            with anyio.fail_after(60):
                await push_to_storage(cache)
                await cache.store(tokens, kv)
                await push_to_storage(cache)
                served = await read_back(cache, tokens, kv)
        if not any(kind == "folder" for kind, _ in mutations):
            assert served == PAGES * PAGE_SIZE, mutations
        await cache.wait_idle()
        assert_consistent(cache)
        assert cache.stats().storage[entry["kind"]].backend.errors == 0
    if entry["kind"] == "file":
        assert open_fds() == fds, "descriptors leaked"


@pytest.mark.parametrize(("kind", "n"), [("file", 50), ("redis", 30), ("mooncake", 3)])
def test_hostile_store_contents(stores: dict, kind: str, n: int) -> None:
    entry = entry_for(kind, stores)

    @examples(n)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        keyed = data.draw(st.booleans(), label="keyed")
        choices = COMMON + (KEYED_ONLY if keyed else []) + (FOLDER_ONLY if kind == "file" else [])
        mutations = data.draw(
            st.lists(st.tuples(st.sampled_from(choices), st.integers(0, 2**31)), min_size=PAGES, max_size=PAGES),
            label="mutations",
        )
        fresh = {**entry, "path": str(Path(entry["path"]).parent / uuid.uuid4().hex)} if kind == "file" else {
            **entry, "key_prefix": f"f{uuid.uuid4().hex[:12]}"}
        anyio.run(run_example, fresh, keyed, mutations)

    run()
