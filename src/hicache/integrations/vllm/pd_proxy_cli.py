"""The ``hicache pd-proxy`` command: its flags, the file descriptor check, and the server until a signal.

The proxy itself is ``pd_proxy``; its caps ``pd_proxy_limits``. Every flag is a ``ProxySettings`` field
(``docs/engines/pd.md``, "The proxy").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import replace

from .pd_proxy import ProxySettings, serve, server_urls
from .pd_proxy_limits import fit_fd_budget, quiet_exception_handler

__all__ = ["main"]


async def _run(settings: ProxySettings, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_exception_handler())  # accept() errors: a few lines, then a count
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner, site, _ = await serve(settings, host, port)
    print(f"hicache pd-proxy on http://{host}:{runner.addresses[0][1]}: prefill {', '.join(settings.prefill)}; "
          f"decode {', '.join(settings.decode)}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hicache pd-proxy",
        description="An OpenAI-compatible proxy for vLLM prefill/decode disaggregation: each request is "
        "prefilled on a prefill server (max_tokens=1), then decoded on a decode server with the "
        "prefill's kv_transfer_params; round robin over several servers of each kind.",
    )
    d = ProxySettings([], [])
    parser.add_argument("--prefill", required=True, help="prefill servers: http://host:port[,http://host:port...]")
    parser.add_argument("--decode", required=True, help="decode servers: http://host:port[,http://host:port...]")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    parser.add_argument("--prefill-timeout-s", type=float, default=d.prefill_timeout_s,
                        help="bound on the whole prefill step")
    parser.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s,
                        help="bound on each read of the decode answer")
    parser.add_argument("--max-in-flight", type=int, default=d.max_in_flight,
                        help=f"requests in flight, all clients together; over it a 503 (default {d.max_in_flight})")
    parser.add_argument("--max-in-flight-per-client", type=int, default=d.max_in_flight_per_client,
                        help=f"requests in flight from one client; over it a 429 "
                        f"(default {d.max_in_flight_per_client})")
    parser.add_argument("--upstream-connections", type=int, default=0,
                        help="the pool of connections to the servers (default: --max-in-flight)")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help=f"open client connections (default {d.max_connections})")
    parser.add_argument("--max-connections-per-client", type=int, default=d.max_connections_per_client,
                        help=f"open connections from one address (default {d.max_connections_per_client})")
    parser.add_argument("--max-body-mb", type=float, default=d.max_body_mb,
                        help=f"largest request body in MiB; over it a 413 (default {d.max_body_mb:g})")
    parser.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                        help=f"time to receive a request body; over it a 408 (default {d.body_timeout_s:g})")
    parser.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDR[/BITS]",
                        help="a peer whose X-Forwarded-For names the client (repeat; default: none, header ignored)")
    args = parser.parse_args(argv)
    try:
        settings = ProxySettings(
            server_urls(args.prefill), server_urls(args.decode), connect_timeout_s=args.connect_timeout_s,
            prefill_timeout_s=args.prefill_timeout_s, read_timeout_s=args.read_timeout_s,
            max_in_flight=args.max_in_flight, max_in_flight_per_client=args.max_in_flight_per_client,
            upstream_connections=args.upstream_connections, max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client, max_body_mb=args.max_body_mb,
            body_timeout_s=args.body_timeout_s, trusted_proxies=tuple(args.trusted_proxy),
        )
        settings.check()
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        fits = fit_fd_budget(settings.max_connections, settings.pool_size)
    except ValueError as exc:
        parser.error(str(exc))
    if fits < settings.max_connections:
        settings = replace(settings, max_connections=fits,
                           max_connections_per_client=min(settings.max_connections_per_client, fits))
    asyncio.run(_run(settings, args.host, args.port))
    return 0

