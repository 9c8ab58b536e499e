"""``hicache soak``: a minute of random multi-client traffic, as CI runs it.

Two runs of the real command: 40 s through a file tier, a Valkey tier and a Mooncake tier that the
soak starts itself (every promise must hold: no lost page, no wrong KV, no broken invariant, every
write-through page in every storage tier after each cache restart), then 20 s with the Valkey
server killed and restarted mid-run (failures are counted, never wrong KV or a broken invariant).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.soak.servers import mooncake_master_binary, valkey_binary

from .mooncake_master import mooncake_client_available
from .servers import unavailable

pytestmark = pytest.mark.slow


def soak(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "soak.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "soak", *args, "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    summary = proc.stdout[proc.stdout.find("hicache soak:"):]
    assert proc.returncode == 0, f"soak failed:\n{summary}\n{proc.stderr[-3000:]}"
    assert "result: OK" in summary
    return json.loads(out.read_text())


def test_a_soak_keeps_every_promise_across_file_valkey_and_mooncake(tmp_path: Path) -> None:
    if valkey_binary() is None or mooncake_master_binary() is None or mooncake_client_available():
        unavailable("the soak needs valkey-server and mooncake_master")
    report = soak(tmp_path, "--seconds", "40", "--servers", "valkey,mooncake", "--phase", "13")
    assert report["restarts"] >= 3 and report["ops"]["retrieve"] > 50
    assert report["lost_pages"] == 0 and report["wrong_kv"] == 0 and not report["violations"]
    assert report["owed_checked"] > 0 and report["owed_found"] == report["owed_checked"]
    assert report["pages_moved"]["host_to_storage"] > 0
    assert report["pages_moved"]["storage_to_host"] > 0  # conversations resumed after a restart came from storage
    assert report["cancelled"], "no request was cancelled mid-way"


def test_a_soak_with_a_server_killed_mid_run_never_serves_wrong_kv(tmp_path: Path) -> None:
    if valkey_binary() is None:
        unavailable("the soak needs valkey-server")
    report = soak(tmp_path, "--seconds", "20", "--servers", "valkey", "--faults", "--phase", "10")
    assert report["faults"] and report["storage_failures"] > 0
    assert report["wrong_kv"] == 0 and not report["violations"]
