"""A second engine process reuses the KV a first one computed, through the file tier, and answers the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def serve(pages: Path, seed: int, extra: int) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.lm_process", str(pages), str(seed), str(extra)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_first_ones_kv_and_gives_the_same_answers(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    first = serve(pages, seed=1, extra=0)
    assert first["cached_tokens"] == 0 and first["logits_ok"] and first["matches_no_cache"]
    # A fresh process, a longer prompt it never saw: the first 144 tokens come from the first one's pages.
    second = serve(pages, seed=1, extra=40)
    assert second["by_tier"]["file"] == 144 and second["cached_tokens"] == 144
    assert second["logits_ok"] and second["matches_no_cache"]
    # And the first prompt again, in a third process: all of it from the file tier, same answer.
    third = serve(pages, seed=1, extra=0)
    assert third["by_tier"]["file"] == 144 and third["output"] == first["output"]
