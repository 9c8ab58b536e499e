"""A real ``mooncake_master`` for the Mooncake tests: loopback, free ports, stopped by PID.

``start_mooncake(workdir)`` returns the running ``ServerProcess`` and the ``MooncakeBackend``
settings (YAML keys) that reach it. ``ServerProcess.kill()`` then ``start()`` restarts it on the same
ports, as a crashed and restarted master would come back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hicache.soak.servers import start_mooncake_master
from tests.servers import ServerProcess, mooncake_master_binary, unavailable

__all__ = ["start_mooncake", "mooncake_client_available"]


def mooncake_client_available() -> str | None:
    """``None`` when ``mooncake.store`` imports, else why not."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # ImportError, or a missing shared library (OSError)
        return f"mooncake.store does not import: {exc}"
    return None


def start_mooncake(workdir: Path, *, lease_ms: int = 5000, **overrides: Any) -> tuple[ServerProcess, dict[str, Any]]:
    """Start a master; return it and the backend settings (``overrides`` are merged into them)."""
    why = mooncake_client_available()
    if why is not None:
        unavailable(why)
    binary = mooncake_master_binary()
    if binary is None:
        unavailable("no mooncake_master binary (pip install mooncake-transfer-engine-non-cuda)")
        raise AssertionError("unreachable")
    try:
        master = start_mooncake_master(binary, Path(workdir), lease_ms=lease_ms)
    except Exception as exc:
        unavailable(f"mooncake_master did not start: {exc}")
        raise
    server, rpc_port, http_port, metrics_port = master.server, master.rpc_port, master.http_port, master.metrics_port
    settings: dict[str, Any] = {
        "master": f"127.0.0.1:{rpc_port}",
        "metadata_server": f"http://127.0.0.1:{http_port}/metadata",
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": 64 * 1024**2,
        "local_buffer_size": 16 * 1024**2,
        "admin_url": f"http://127.0.0.1:{metrics_port}",  # the master's admin port: listing (hicache inspect)
        **overrides,
    }
    return server, settings


if __name__ == "__main__":  # manual use: start one and print its settings until Ctrl-C
    import tempfile
    import time

    folder = Path(tempfile.mkdtemp(prefix="mooncake-"))
    srv, cfg = start_mooncake(folder)
    print(cfg, flush=True)
    try:
        while True:
            time.sleep(1)
    finally:
        srv.stop()
