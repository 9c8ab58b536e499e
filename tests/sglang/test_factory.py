"""SGLang's backend factory builds the backend from what SGLang really passes; a misconfiguration is a
clear error when it does, and nothing SGLang adds (None fields, its own keys, new keys) fails it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.errors import ConfigError, UnsupportedModelError

from .harness import MODULE, Shape, backend, fill, page_bytes, page_hashes, pools, storage_config, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")


def test_the_factory_builds_it_from_sglangs_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from hicache.integrations.sglang import HiCacheStorageBackend

    _, host = pools("page_first")
    extra = {
        "interface_v1": 1, "storage": [{"kind": "file", "path": str(tmp_path)}],
        "hicache_storage_pass_prefix_keys": True,  # SGLang's own keys, some of which it leaves in
        "prefetch_threshold": 256, "a_key_of_a_later_sglang": {"x": 1}, "metrics_port": None,
    }
    config = storage_config(extra)
    assert config.tp_lcm_size is None and config.dp_rank == 0  # as SGLang 0.5.23 passes them
    with caplog.at_level(logging.WARNING, logger="hicache.sglang"):
        made = StorageBackendFactory.create_backend("dynamic", config, host)
    assert type(made) is HiCacheStorageBackend
    assert "a_key_of_a_later_sglang" in caplog.text and "prefetch_threshold" not in caplog.text
    made.register_mem_pool_host(host)
    try:
        ps = host.page_size
        tokens = tokens_for(4, ps, seed=1)
        keys = page_hashes(tokens, ps)
        slots = host.alloc(len(tokens))
        fill(host, slots, seed=2)
        assert made.batch_exists(keys) == 0
        assert made.batch_set_v1(keys, slots) == [True] * 4
        assert made.batch_exists(keys) == 4 and made.batch_exists([*keys[:2], "f" * 64, keys[3]]) == 2
        assert made.exists(keys[0]) and not made.exists("0" * 64)
        back = host.alloc(len(tokens))
        assert made.batch_get_v1(keys, back) == [True] * 4
        assert torch.equal(page_bytes(host, back), page_bytes(host, slots))
        # The copy path's single-page calls.
        page = made.get(keys[2], host.get_dummy_flat_data_page())
        assert page is not None and torch.equal(page.view(torch.uint8), host.get_data_page(int(slots[2 * ps])).view(torch.uint8))
        assert made.get("e" * 64, host.get_dummy_flat_data_page()) is None
        assert made.set("d" * 64, host.get_data_page(int(slots[0]))) and made.exists("d" * 64)
        # Wrong host indices (not whole pages, too few) are a miss, not an exception.
        assert made.batch_get_v1(keys[:2], back[1 : 1 + 2 * ps]) == [False, False]
        assert made.batch_set_v1(keys[:2], back[:ps]) == [False, False]
        assert made.failed_calls == 2
    finally:
        made.close()
        made.close()  # idempotent (SGLang's detach and exit may both close it)
    assert made.batch_exists(keys) == 0  # closed: a miss, not an exception


def test_the_config_file_and_overrides_work(tmp_path: Path) -> None:
    yaml = tmp_path / "hicache.yaml"
    yaml.write_text(f"tiers:\n  storage:\n    - kind: file\n      path: {tmp_path / 'pages'}\n      capacity: 1MiB\n")
    _, host = pools("page_first_direct")
    made = backend(host, {"config": str(yaml), "overrides": {"model": {"revision": "weights-v2"}}})
    try:
        assert made.config.model.revision == "weights-v2"
        assert made.config.model.name == "test-model|sglang-layer-major"
        assert made._chain.tiers[0].backend.settings.capacity == 1024**2
        assert (made.config.page_size, made.config.model.num_layers, made.config.model.num_kv_heads) == (8, 3, 2)
    finally:
        made.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "at least one storage tier"),
        ({"config": "/nonexistent/hicache.yaml"}, "no hicache config file"),
        ({"storage": [{"kind": "nosuchstore"}]}, "unknown storage backend 'nosuchstore'"),
        ({"storage": [{"kind": "file"}]}, "path"),
        ({"storage": [{"kind": "file", "path": "/tmp/x", "capacity": "lots"}]}, "capacity"),
        ({"storage": [{"kind": "memory"}], "timeout_s": -1}, "timeout_s"),
        ({"storage": [{"kind": "memory"}], "overrides": {"policies": {"eviction": "random"}}}, "eviction"),
    ],
)
def test_a_misconfiguration_is_a_clear_error_at_construction(extra: dict[str, Any], message: str) -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    with pytest.raises(ConfigError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


def test_a_model_without_a_name_is_refused_unless_the_config_names_it() -> None:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    with pytest.raises(ConfigError, match="no model name"):
        StorageBackendFactory.create_backend("dynamic", storage_config({"storage": [{"kind": "memory"}]}, model=None), None)
    named = {"storage": [{"kind": "memory"}], "overrides": {"model": {"name": "my-model"}}}
    made = StorageBackendFactory.create_backend("dynamic", storage_config(named, model=None), None)
    made.close()


def test_what_cannot_be_cached_is_refused_when_the_pool_registers() -> None:
    _, host = pools("page_first", Shape(dtype=torch.float8_e4m3fn))
    with pytest.raises(UnsupportedModelError, match="dtype"):
        backend(host, {"storage": [{"kind": "memory"}]})
    _, mha = pools("page_first")
    with pytest.raises(UnsupportedModelError, match="MLA model"):  # SGLang says MLA, the pool is not
        backend(mha, {"storage": [{"kind": "memory"}]}, mla=True)


def test_sglangs_controller_loads_it_by_name(tmp_path: Path) -> None:
    """``--hicache-storage-backend dynamic`` with the module path and class name, as SGLang does."""
    from .harness import Rig

    device, host = pools("page_first")
    rig = Rig(device, host, {"interface_v1": 1, "storage": [{"kind": "file", "path": str(tmp_path)}]})
    try:
        assert type(rig.storage).__name__ == "HiCacheStorageBackend" and rig.storage.mem_pool_host is host
        assert rig.controller.storage_config.extra_config["module_path"] == MODULE["module_path"]
    finally:
        rig.close()


def test_a_hybrid_models_other_host_pools_are_refused_and_the_tiers_closed(tmp_path: Path) -> None:
    """SGLang's hybrid controller registers every host pool with ``register_mem_host_pool_v2``; ``kv``
    and ``swa`` are served (``test_swa.py``), so a Mamba (or indexer) pool fails the attach with the
    reason, not as silent misses and lost backups later."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    _, host = pools("page_first")
    made = backend(host, {"interface_v1": 1, "storage": [{"kind": "file", "path": str(tmp_path)}]})
    made.register_mem_host_pool_v2(host, PoolName.KV)  # the anchor pool, as the hybrid controller passes it
    assert "open" in repr(made)
    for name in (PoolName.MAMBA, PoolName.INDEXER):
        with pytest.raises(UnsupportedModelError, match=f"host pool '{name.value}'.*docs/models.md"):
            made.register_mem_host_pool_v2(host, name)
        assert "closed" in repr(made)
