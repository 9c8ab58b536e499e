"""A stand-in for ``hicache.bench.vllm_worker`` in the turn-taking tests: no engine, the real protocol.

``python -m tests.turn_worker OUT.json < spec.json``: takes ``spec["requests"]`` turns through
``TurnPipe``, appending ``NAME K`` to ``spec["log"]`` inside each. Fault injection, named as such:
``die_at`` exits in that turn without saying ``done``; ``stall_at`` sleeps through that turn.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hicache.bench.vllm_turns import TurnPipe


def main() -> None:
    spec = json.loads(sys.stdin.read())
    turns = TurnPipe.from_spec(spec["turns"])
    assert turns is not None
    name = spec["configuration"]
    turns.ready()
    for k in range(spec["requests"]):
        turns.acquire()
        with open(spec["log"], "a") as log:
            log.write(f"{name} {k}\n")
        if spec.get("die_at") == k:
            os._exit(3)
        if spec.get("stall_at") == k:
            time.sleep(60)
        turns.release(lambda: time.sleep(0.001))
    Path(sys.argv[1]).write_text(json.dumps({"configuration": name, "wall_s": turns.busy_s, "drain_s": turns.drain_s}))


if __name__ == "__main__":
    main()
