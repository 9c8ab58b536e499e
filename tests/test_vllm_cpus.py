"""Which CPUs the connector gives the cache's threads (integrations/vllm/cpus.py), on this machine's
real CPUs: a core one of the process's threads is bound to is the model's, not spare.

Each case runs in a fresh interpreter, whose threads it binds as vLLM binds its worker's OpenMP
threads (the main thread to the first core, each other thread to one more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux and two CPUs")

BIND = """
import json, os, sys, threading
cpus = sorted(os.sched_getaffinity(0))
threads = int(sys.argv[1])  # bound threads besides the main one, as OpenMP's team
if sys.argv[2] == "unbound":  # a thread started before the binding keeps every CPU
    threading.Thread(target=threading.Event().wait, args=(30,), daemon=True).start()
os.sched_setaffinity(0, {cpus[0]})  # as libgomp binds the main thread when it loads, before any other starts
from hicache.integrations.vllm.cpus import model_cpus, reserved_cpus
release, bound = threading.Event(), threading.Barrier(threads + 1, timeout=30)
def member(cpu):
    os.sched_setaffinity(0, {cpu})
    bound.wait()
    release.wait(30)
for i in range(threads):
    threading.Thread(target=member, args=(cpus[1 + i],)).start()
bound.wait()  # every member is bound
found = reserved_cpus()
print(json.dumps({"cpus": cpus, "model": sorted(model_cpus()),
                  "reserved": None if found is None else [sorted(found[0]), sorted(found[1])]}))
release.set()
"""


def _bind(threads: int, unbound: bool = False) -> dict:
    argv = [sys.executable, "-c", BIND, str(threads), "unbound" if unbound else "-"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def test_the_cores_left_over_from_the_model_threads_are_spare() -> None:
    got = _bind(threads=0)
    assert got["model"] == got["cpus"][:1]
    assert got["reserved"] == [got["cpus"][:1], got["cpus"][1:]]


def test_a_core_another_model_thread_holds_is_not_spare() -> None:
    """vLLM with no core reserved on two: the main thread on core 0 and an OpenMP thread on core 1;
    reading the main thread's binding alone took core 1 for spare and put every cache thread there."""
    cpus = sorted(os.sched_getaffinity(0))
    got = _bind(threads=len(cpus) - 1)
    assert got["model"] == cpus
    assert got["reserved"] is None


def test_a_thread_bound_nowhere_leaves_nothing_spare() -> None:
    """Where a thread of the process may run anywhere, no core is known to be free of the model's
    work: the cache's threads are not moved (as in vLLM's single-process mode)."""
    got = _bind(threads=0, unbound=True)
    assert got["model"] == sorted(os.sched_getaffinity(0))
    assert got["reserved"] is None
