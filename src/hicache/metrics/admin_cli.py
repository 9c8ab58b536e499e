"""``hicache admin``: attach or detach storage tiers of a running process, through its admin endpoint.

    hicache admin storage                                # the chain, fastest first
    hicache admin attach entry.yaml [--position 0]       # one tiers.storage item, as in a config
    hicache admin detach NAME [--no-drain] [--timeout 30]

The endpoint is ``hicache.metrics.serve(cache, port, admin=True, admin_token=...)`` in that process
(``--url``, default ``http://127.0.0.1:9400``); the token comes from ``$HICACHE_ADMIN_TOKEN``. The
entry file's ``${VAR}`` are expanded here, from this shell's environment, never the server's.
Every request says ``Content-Type: application/json`` and no ``Origin``, and names ``--url``'s host
in ``Host``: a server without a token takes it from a loopback ``--url`` only (``admin_auth``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

__all__ = ["main"]


def _call(url: str, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    token = os.environ.get("HICACHE_ADMIN_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        raise SystemExit(f"error: {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"error: cannot reach {url}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache admin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:9400", help="the process's metrics/admin address")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer")
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("storage", help="print the storage chain")
    attach = sub.add_parser("attach", help="attach a storage tier described by a YAML file (one tiers.storage item)")
    attach.add_argument("entry", help="YAML file holding one mapping: kind, name and the backend's settings")
    attach.add_argument("--position", type=int, default=None, help="0 = fastest (default: the end)")
    detach = sub.add_parser("detach", help="detach a storage tier by name")
    detach.add_argument("name")
    detach.add_argument("--no-drain", action="store_true", help="cancel its prefetches and writes instead of finishing them")
    detach.add_argument("--drain-timeout", type=float, default=None, help="seconds to drain at most")
    args = parser.parse_args(argv)
    if args.verb == "storage":
        reply = _call(args.url, "/admin/storage", None, args.timeout)
    elif args.verb == "attach":
        from ..config_yaml import Budget, read_yaml, substitute
        from ..errors import ConfigError

        try:
            entry = substitute(read_yaml(args.entry), os.environ, args.entry, (), Budget(args.entry))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        reply = _call(args.url, "/admin/storage/attach", {"entry": entry, "position": args.position}, args.timeout)
    else:
        body = {"name": args.name, "drain": not args.no_drain, "timeout_s": args.drain_timeout}
        reply = _call(args.url, "/admin/storage/detach", body, args.timeout)
    print(json.dumps(reply, indent=2))
    return 0
