"""What operators see of the backend: hicache's Prometheus metrics per rank, SGLang's own storage
metrics (``get_stats``), and ``hicache inspect`` over the tier with the config the backend dumped."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from hicache.inspect.cli import main as inspect_main

from .harness import backend, fill, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")


def test_metrics_stats_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pages_dir = tmp_path / "pages"
    dump = tmp_path / "hicache-tp{tp_rank}.yaml"
    extra = {
        "interface_v1": 1, "storage": [{"kind": "file", "path": str(pages_dir)}], "metrics_port": 0,
        "dump_config": str(dump), "overrides": {"tenant_key": "a-tenant-key-of-24-chars"},
    }
    _, host = pools("page_first")
    b = backend(host, extra)
    try:
        ps = host.page_size
        tokens = tokens_for(6, ps, seed=1)
        keys = page_hashes(tokens, ps)
        slots = host.alloc(len(tokens))
        fill(host, slots, seed=2)
        assert all(b.batch_set_v1(keys, slots))
        back = host.alloc(len(tokens))
        assert b.batch_exists(keys) == 6 and all(b.batch_get_v1(keys, back))

        text = urllib.request.urlopen(f"http://127.0.0.1:{b._metrics.port}/metrics", timeout=10).read().decode()
        assert 'hicache_storage_stored_pages_total{kind="file",pp_rank="0",tier="file",tp_rank="0"} 6.0' in text
        assert 'hicache_storage_fetched_pages_total{kind="file",pp_rank="0",tier="file",tp_rank="0"} 6.0' in text
        assert 'hicache_lookups_total{pp_rank="0",tp_rank="0"} 1.0' in text
        assert "hicache_storage_backend_call_seconds_bucket" in text

        sgl = b.get_stats()  # SGLang's StorageMetrics, drained at each ask
        assert sgl.backup_pgs == [6] and sgl.prefetch_pgs == [6] and len(sgl.prefetch_bandwidth) == 1
        assert b.get_stats().backup_pgs == []

        dumped = tmp_path / "hicache-tp0.yaml"
        assert "a-tenant-key" not in dumped.read_text()  # the secret is masked
    finally:
        b.close()

    # hicache inspect with the dumped config (the tenant key from the environment) verifies every page.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_TENANT_KEY", "a-tenant-key-of-24-chars")
        assert inspect_main(["verify", str(dumped), "--json", "--quiet"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["ok"], report["corrupt"]) == (6, []), report
        victim = next(pages_dir.glob("*/*.kv"))
        data = bytearray(victim.read_bytes())
        data[-1] ^= 1
        victim.write_bytes(bytes(data))
        assert inspect_main(["verify", str(dumped), "--quiet"]) == 1  # the corrupt page is found
