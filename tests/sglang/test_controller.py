"""Through SGLang's real ``HiCacheController``: backup and prefetch, bit-exact, over every host layout and
both data paths, under SGLang's own fault injection, with a corrupted page and a storage that stalls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.keys import external_page_keys

from .harness import LAYOUTS, MLA_LAYOUTS, SMALL, Rig, Shape, fill, page_bytes, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")

CASES = [("mha", layout) for layout in LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]


@pytest.fixture
def rigs() -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(layout: str, extra: dict[str, Any], *, mla: bool = False, shape: Shape = SMALL) -> Rig:
        device, host = pools(layout, Shape(**{**shape.__dict__, "mla": mla}))
        rig = Rig(device, host, extra)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


def file_tier(path: Path, **options: Any) -> dict[str, Any]:
    return {"storage": [{"kind": "file", "path": str(path), **options}]}


@pytest.mark.parametrize("v1", [1, 0], ids=["zero-copy", "copy"])
@pytest.mark.parametrize(("attention", "layout"), CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
def test_backup_then_prefetch_is_bit_exact(
    rigs: Callable[..., Rig], tmp_path: Path, attention: str, layout: str, v1: int
) -> None:
    """130 pages (two of SGLang's 128-page batches) out through backup, back through prefetch into
    other host slots: the same bytes, and the pages SGLang reads are ones hicache verified."""
    rig = rigs(layout, {"interface_v1": v1, **file_tier(tmp_path)}, mla=attention == "mla")
    assert rig.controller.page_get_func.__name__ == ("_page_get_zero_copy" if v1 else "_generic_page_get")
    ps = rig.host.page_size
    tokens = tokens_for(130, ps, seed=1)
    slots = rig.host.alloc(len(tokens))
    fill(rig.host, slots, seed=2)
    assert rig.backup(slots, tokens) == len(tokens)
    back, hit, loaded = rig.prefetch(tokens)
    assert hit == loaded == len(tokens)
    assert not bool((back[::ps] == slots[::ps]).any())  # other slots, filled from storage
    assert torch.equal(page_bytes(rig.host, back), page_bytes(rig.host, slots))
    stats = rig.storage.stats()
    assert stats.storage["file"].stored_pages == 130 and stats.storage["file"].fetched_pages == 130
    assert stats.storage["file"].backend.corrupt_pages == 0 and rig.storage.failed_calls == 0
    # A second backup of the same pages writes nothing: the tier has them.
    assert rig.backup(slots, tokens) == len(tokens)
    assert rig.storage.stats().storage["file"].stored_pages == 130


def test_both_paths_and_matching_layouts_share_pages(rigs: Callable[..., Rig], tmp_path: Path) -> None:
    """Pages are SGLang's flat pages on both paths: written zero-copy from a layer_first pool, they are
    read by the copy path and by a page_first_direct pool (same byte order), never by page_first."""
    writer = rigs("layer_first", {"interface_v1": 1, **file_tier(tmp_path)})
    tokens = tokens_for(5, 8, seed=3)
    slots = writer.host.alloc(len(tokens))
    fill(writer.host, slots, seed=4)
    assert writer.backup(slots, tokens) == len(tokens)
    want = page_bytes(writer.host, slots)
    for layout, v1 in (("layer_first", 0), ("page_first_direct", 1), ("page_first_direct", 0)):
        reader = rigs(layout, {"interface_v1": v1, **file_tier(tmp_path)})
        back, hit, loaded = reader.prefetch(tokens)
        assert hit == loaded == len(tokens), layout
        assert torch.equal(page_bytes(reader.host, back), want), layout
    token_major = rigs("page_first", {"interface_v1": 1, **file_tier(tmp_path)})
    assert token_major.prefetch(tokens)[1] == 0  # token-major pages are another namespace


def test_sglang_fault_injection_never_breaks_a_prefix(
    rigs: Callable[..., Rig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's injector (random delays, calls failing at random) wraps the backend: whatever SGLang
    loads is exact, failures are misses, and no SGLang thread sees an exception."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    rig = rigs("page_first_direct", {"interface_v1": 1, **file_tier(tmp_path)})
    assert type(rig.storage).__name__ == "HiCacheStorageFailureInjector"
    ps = rig.host.page_size
    results = []
    for round_ in range(12):
        tokens = tokens_for(3, ps, seed=100 + round_)
        slots = rig.host.alloc(len(tokens))
        fill(rig.host, slots, seed=200 + round_)
        written = rig.backup(slots, tokens)
        back, hit, loaded = rig.prefetch(tokens)
        assert loaded <= hit <= written or written == 0
        n = loaded // ps
        assert torch.equal(page_bytes(rig.host, back[: n * ps]), page_bytes(rig.host, slots[: n * ps]))
        results.append((written, hit, loaded))
        rig.host.free(slots)
        if back.numel():
            rig.host.free(back)
    assert errors == []
    assert any(r[2] == 3 * ps for r in results)  # some round trips got through whole
    assert any(r != (3 * ps,) * 3 for r in results)  # and injected failures cut others short


def test_a_corrupted_page_is_a_miss_and_is_dropped(rigs: Callable[..., Rig], tmp_path: Path) -> None:
    rig = rigs("page_first", {"interface_v1": 1, **file_tier(tmp_path)})
    ps = rig.host.page_size
    tokens = tokens_for(6, ps, seed=5)
    slots = rig.host.alloc(len(tokens))
    fill(rig.host, slots, seed=6)
    assert rig.backup(slots, tokens) == len(tokens)
    backend = rig.storage
    names = backend._chain.tiers[0].codec.storage_keys(external_page_keys(backend.namespace.digest, page_hashes(tokens, ps)))
    victim = tmp_path / names[3].hex()[:2] / f"{names[3].hex()}.kv"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x40  # one bit of the payload
    victim.write_bytes(bytes(data))

    back, hit, loaded = rig.prefetch(tokens)
    assert hit == len(tokens)  # present, as far as a listing can tell
    assert loaded == 3 * ps  # the pages before it, verified; not the corrupt one, nor those after it
    assert torch.equal(page_bytes(rig.host, back[:loaded]), page_bytes(rig.host, slots[:loaded]))
    assert backend.stats().storage["file"].backend.corrupt_pages == 1
    assert not victim.exists()  # dropped, so the next backup writes it again
    assert rig.backup(slots, tokens) == len(tokens)
    back2, _, loaded2 = rig.prefetch(tokens)
    assert loaded2 == len(tokens) and torch.equal(page_bytes(rig.host, back2), page_bytes(rig.host, slots))


def test_storage_that_stalls_is_a_bounded_miss(rigs: Callable[..., Rig], tmp_path: Path) -> None:
    """A tier whose every call hangs (a dead peer): each SGLang call returns after timeout_s as a miss
    or an unwritten page, counted; SGLang's controller carries on."""
    extra = {"interface_v1": 1, "timeout_s": 0.3, "storage": [{"kind": "tests.fakes:StallingStorageBackend"}]}
    rig = rigs("page_first", extra)
    ps = rig.host.page_size
    tokens = tokens_for(2, ps, seed=7)
    slots = rig.host.alloc(len(tokens))
    fill(rig.host, slots, seed=8)
    start = time.monotonic()
    assert rig.backup(slots, tokens) == 0
    assert rig.prefetch(tokens)[1] == 0
    assert time.monotonic() - start < 5
    assert rig.storage._chain.timeouts == 2  # the write's existence check, the hit query
