"""``bench vllm --interleave``'s turn taking, between real processes over real pipes (no vLLM needed)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hicache.bench import vllm_turns
from hicache.bench.vllm_turns import run_in_turns, turn_order

ROOT = Path(__file__).resolve().parents[1]


def _env(_spec: dict[str, Any]) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))


def _specs(tmp_path: Path, names: list[str], requests: int, **faults: dict[str, int]) -> list[dict[str, Any]]:
    log = tmp_path / "turns.log"
    return [{"configuration": n, "requests": requests, "log": str(log), **faults.get(n, {})} for n in names]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _none_left_beyond(before: set[int]) -> bool:
    """No process this test started is still alive (servers other tests left running are not ours)."""
    deadline = time.monotonic() + 5
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _children() - before


def test_turn_order_reverses_every_other_round() -> None:
    assert turn_order(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert turn_order(["a", "b"], 2) == ["a", "b", "b", "a"]


def test_every_process_serves_its_requests_only_in_its_own_turns(tmp_path: Path) -> None:
    names = ["vllm", "vllm+hicache", "vllm-unbounded"]
    before = _children()
    results = run_in_turns(_specs(tmp_path, names, 5), 5, _env, module="tests.turn_worker", progress=False)
    served = (tmp_path / "turns.log").read_text().split("\n")[:-1]
    assert served == [f"{n} {k // 3}" for k, n in enumerate(turn_order(names, 5))]
    for name in names:
        r = results[name]
        assert r["interleaved_with"] == names and len(r["drain_s"]) == 5
        assert 0 < r["wall_s"] and all(d >= 0.001 for d in r["drain_s"])
    assert _none_left_beyond(before)


def test_a_worker_that_dies_mid_run_ends_the_run_naming_it_and_the_others_are_killed(tmp_path: Path) -> None:
    names = ["a", "b"]
    before = _children()
    with pytest.raises(SystemExit, match="configuration b exited"):
        run_in_turns(_specs(tmp_path, names, 4, b={"die_at": 1}), 4, _env, module="tests.turn_worker", progress=False)
    assert (tmp_path / "turns.log").read_text().split("\n")[:-1] == ["a 0", "b 0", "b 1"]
    assert _none_left_beyond(before)


def test_a_worker_that_stalls_is_bounded_by_the_turn_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_turns, "TURN_TIMEOUT_S", 1.0)
    before = _children()
    started = time.monotonic()
    with pytest.raises(SystemExit, match="configuration a did not say 'done' within 1 s"):
        run_in_turns(_specs(tmp_path, ["a", "b"], 3, a={"stall_at": 0}), 3, _env, module="tests.turn_worker",
                     progress=False)
    assert time.monotonic() - started < 30
    assert _none_left_beyond(before)


def test_a_worker_that_never_boots_ends_the_run_naming_it(tmp_path: Path) -> None:
    before = _children()
    with pytest.raises(SystemExit, match="configuration a exited"):
        run_in_turns(_specs(tmp_path, ["a"], 2), 2, _env, module="tests.no_such_worker", progress=False)
    assert _none_left_beyond(before)
