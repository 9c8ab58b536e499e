"""``serve(cache, port)``: a small HTTP server on the cache's event loop for ``/metrics`` and the admin API.

For a process that has no metrics server of its own (an engine that has one registers
``HiCacheCollector`` in its registry instead). It runs as tasks of the caller's event loop (the
cache's), so a scrape reads the counters on the thread that changes them and an admin request calls
``attach_storage`` / ``detach_storage`` directly, with no thread hop and no lock.

Routes:

* ``GET /metrics``: the Prometheus text format (``registry``: the cache's collector, plus whatever
  else the caller registered, e.g. ``EngineMetrics``);
* ``GET /healthz``: ``200 ok`` while the cache serves, ``503`` once it failed or closed;
* with ``admin=True``: ``GET /admin/storage`` (the chain, JSON), ``POST /admin/storage/attach``
  (``{"entry": {...}, "position": null}``) and ``POST /admin/storage/detach``
  (``{"name": "...", "drain": true, "timeout_s": null}``). Admin requests need
  ``Authorization: Bearer <admin_token>`` when a token is set; an admin server on an address other
  than loopback refuses to start without one, and without one takes admin requests from no web page
  (a loopback ``Host``, no ``Origin``: ``admin_auth``). Admin POSTs need ``Content-Type: application/json``.

Connections are accepted by ``accept.serve_connections``: at most ``max_connections`` at once, and
no accept error (``EMFILE`` under fd pressure or a flood) or handler error ends the caller's block.

Why an endpoint and not a CLI that talks to the process some other way: a running engine already
exposes an HTTP port for metrics to its operators (and Prometheus), the attach/detach calls must
run on the cache's event loop, and an HTTP request is something any deployment tool can send.
``hicache admin`` is a thin client of these routes.

HTTP/1.1 is parsed by h11 (the sans-IO parser under httpcore and uvicorn) over the anyio stream.
Requests are bounded (request line and headers 16 KiB however the bytes arrive, bodies 64 KiB, JSON
32 levels deep, 10 s to send them) and answered with ``Connection: close``; a malformed request gets
a 400 (431 for a head too large, 413 for a body) and never reaches the cache. An attach entry is
validated as one from a request (``HiCache.attach_storage(..., from_request=True)``): a built-in
``kind`` or an installed plugin only, and nothing read from this process's environment; no answer
quotes anything but the request and the validation's own messages (secrets never shown).
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import anyio
import h11
from anyio.abc import SocketStream
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..errors import ConfigError, HiCacheError
from .accept import serve_connections
from .admin_auth import admin_refusal
from .collector import HiCacheCollector

if TYPE_CHECKING:
    from ..cache import HiCache

__all__ = ["MetricsServer", "registry_for", "serve"]

log = logging.getLogger(__name__)

_MAX_HEAD = 16 * 1024  # request line and headers
_MAX_BODY = 64 * 1024
_MAX_DEPTH = 32  # of a JSON body: an entry is a few levels deep
_TOO_DEEP = f"the body is not JSON this server takes: nested deeper than {_MAX_DEPTH} levels"
_READ_TIMEOUT_S = 10.0
_RECEIVE_BYTES = 65536
_DRAIN_S, _DRAIN_BYTES = 1.0, 1024 * 1024  # after an error answer (see _respond)
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 413: "Payload Too Large", 415: "Unsupported Media Type",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
MAX_CONNECTIONS = 64  # serve()'s default: a scraper and an operator need a few; a flood gets no more fds


def registry_for(cache: HiCache, **collector_options: Any) -> CollectorRegistry:
    """A fresh registry holding the cache's collector (merge it: ``registry.register(...)`` more)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HiCacheCollector(cache, **collector_options))
    return registry


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class MetricsServer:
    """A running server: ``url`` / ``port`` to reach it; closed when the ``serve`` block exits."""

    def __init__(self, cache: HiCache, registry: CollectorRegistry, admin: bool, admin_token: str | None) -> None:
        self.cache = cache
        self.registry = registry
        self.admin = admin
        self._token = admin_token
        self.host = ""
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- HTTP -----------------------------------------------------------------------------------

    async def handle(self, stream: SocketStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
            try:
                try:
                    with anyio.fail_after(_READ_TIMEOUT_S):
                        request, body = await _read_request(stream, conn)
                except TimeoutError:
                    return  # a client that does not finish its request in time: dropped
                headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers]
                status, ctype, payload = await self._route(
                    request.method.decode("ascii", "replace"), request.target.decode("latin-1"), headers, body
                )
            except _BadRequest as exc:
                status, ctype, payload = exc.status, "application/json", _json({"error": str(exc)})
            except h11.RemoteProtocolError as exc:  # what h11 refuses: a malformed or oversized request
                status = exc.error_status_hint
                message = (f"the request line and headers are at most {_MAX_HEAD} bytes" if status == 431
                           else f"malformed request: {str(exc)[:200]}")
                ctype, payload = "application/json", _json({"error": message})
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                return
            except Exception as exc:  # a bug must cost one request a 500, never the server (or the caller's block)
                log.error("metrics server: %s failed", type(exc).__name__, exc_info=exc)
                # Only the type: a message may quote anything the process holds.
                status, ctype, payload = 500, "application/json", _json(
                    {"error": f"internal error ({type(exc).__name__}); the server's log has the details"})
            await _respond(stream, conn, status, ctype, payload)

    async def _route(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if path == "/metrics":
            _allow(method, "GET")
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            _allow(method, "GET")
            try:
                self.cache.controller.check_open()
            except HiCacheError as exc:
                return 503, "text/plain; charset=utf-8", f"unavailable: {exc}\n".encode()
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if not (self.admin and path.startswith("/admin/")):
            raise _BadRequest(404, f"no route {path}")
        refusal = admin_refusal(method, headers, self._token)  # before anything is read or changed
        if refusal is not None:
            raise _BadRequest(*refusal)
        return 200, "application/json", _json(await self._admin(method, path, body))

    async def _admin(self, method: str, path: str, body: bytes) -> Any:
        cache = self.cache
        if path == "/admin/storage":
            _allow(method, "GET")
            return {"storage": [
                {"name": s.name, "kind": s.kind, "position": s.position} for s in cache.stats().storage.values()
            ]}
        _allow(method, "POST")
        request = _json_body(body)
        try:
            if path == "/admin/storage/attach":
                entry = request.get("entry")
                position = request.get("position")
                log.info("admin: attach storage tier %s (%s) at %s", _name_of(entry), _kind_of(entry),
                         "the end" if position is None else f"position {position}")
                # from_request: a built-in kind or a plugin only, and nothing read from our environment.
                change = await cache.attach_storage(entry, position, from_request=True)  # type: ignore[arg-type]
            elif path == "/admin/storage/detach":
                name = request.get("name")
                if not isinstance(name, str):
                    raise _BadRequest(400, "detach needs {\"name\": \"<tier name>\"}")
                drain = request.get("drain", True)
                timeout = request.get("timeout_s")
                if not isinstance(drain, bool) or not (timeout is None or isinstance(timeout, (int, float))):
                    raise _BadRequest(400, "drain is true or false, timeout_s a number of seconds or null")
                log.info("admin: detach storage tier %s (drain=%s)", name, drain)
                change = await cache.detach_storage(name, drain=drain, timeout_s=timeout)
            else:
                raise _BadRequest(404, f"no admin route {path}")
        except HiCacheError as exc:
            raise _BadRequest(400, str(exc)) from exc
        return asdict(change)


def _allow(method: str, wanted: str) -> None:
    if method != wanted:
        raise _BadRequest(405, f"use {wanted}")


def _name_of(entry: object) -> str:
    return str(entry.get("name") or entry.get("kind")) if isinstance(entry, dict) else "?"


def _kind_of(entry: object) -> str:
    return str(entry.get("kind")) if isinstance(entry, dict) else "?"


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=1) + "\n").encode()


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(400, f"the body is not JSON: {exc}") from None
    except RecursionError:  # the parser's own stack: nested deeper than Python's recursion limit
        raise _BadRequest(400, _TOO_DEEP) from None
    if not isinstance(value, dict):
        raise _BadRequest(400, "the body must be a JSON object")
    if _depth(value) > _MAX_DEPTH:  # what passes the parser may still be too deep to print or validate
        raise _BadRequest(400, _TOO_DEEP)
    return value


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


async def _read_request(stream: SocketStream, conn: h11.Connection) -> tuple[h11.Request, bytes]:
    """One request, parsed by h11, within the limits: ``_MAX_HEAD`` bytes of request line and
    headers, ``_MAX_BODY`` of body (``Content-Length`` or chunked).

    Until the head is complete h11 is handed at most ``_MAX_HEAD + 1`` bytes: it checks
    ``max_incomplete_event_size`` only while an event is incomplete, so a longer head that arrived
    in one read would be parsed whole.
    """
    request: h11.Request | None = None
    body = bytearray()
    pending = b""  # received, not yet handed to h11
    fed = 0  # bytes handed to h11 before the head was complete (all of them still in its buffer)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            if not pending:
                try:
                    pending = await stream.receive(_RECEIVE_BYTES)
                except anyio.EndOfStream:
                    conn.receive_data(b"")  # h11 says what that means: closed idle, or cut off
                    continue
            take = len(pending) if request is not None else _MAX_HEAD + 1 - fed
            conn.receive_data(pending[:take])
            fed += 0 if request is not None else min(take, len(pending))
            pending = pending[take:]
        elif isinstance(event, h11.Request):
            request = event
            length = next((v for k, v in event.headers if k == b"content-length"), None)
            if length is not None and int(length) > _MAX_BODY:  # h11 checked it is a number
                raise _BadRequest(413, f"bodies are at most {_MAX_BODY} bytes")
            if conn.they_are_waiting_for_100_continue:
                await stream.send(conn.send(h11.InformationalResponse(status_code=100, headers=[], reason="Continue")))
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > _MAX_BODY:
                raise _BadRequest(413, f"bodies are at most {_MAX_BODY} bytes")
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, bytes(body)
        else:  # ConnectionClosed before a request: nothing to answer
            raise anyio.EndOfStream


async def _respond(stream: SocketStream, conn: h11.Connection, status: int, ctype: str, payload: bytes) -> None:
    """Send the answer (within ``_READ_TIMEOUT_S``: a client that does not read is dropped) and close.
    After an error, what the client still sends is read and dropped for a moment (bounded), so
    closing with unread bytes does not reset the connection under the answer."""
    headers = [("Content-Type", ctype), ("Content-Length", str(len(payload))), ("Connection", "close")]
    try:
        data = conn.send(h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, "")))
        with anyio.move_on_after(_READ_TIMEOUT_S):
            await stream.send(data + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
        if status >= 400:
            await stream.send_eof()
            with anyio.move_on_after(_DRAIN_S):
                drained = 0
                while drained < _DRAIN_BYTES:
                    drained += len(await stream.receive(_RECEIVE_BYTES))
    except (anyio.BrokenResourceError, anyio.EndOfStream, ConnectionError, h11.LocalProtocolError):
        pass


@asynccontextmanager
async def serve(
    cache: HiCache,
    port: int = 9400,
    host: str = "127.0.0.1",
    *,
    registry: CollectorRegistry | None = None,
    admin: bool = False,
    admin_token: str | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> AsyncGenerator[MetricsServer]:
    """Serve ``/metrics`` (and with ``admin`` the admin routes) while the block runs.

    ``port=0`` picks a free port (``server.port``). ``registry``: what ``/metrics`` exports
    (default: ``registry_for(cache)``); pass your own to merge the cache's metrics with others.
    ``max_connections``: served at once; more are closed at once (``accept``).
    """
    if admin and admin_token is None and not _loopback(host):
        raise ConfigError(f"an admin server on {host} (not loopback) needs an admin_token")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ConfigError(f"max_connections is a whole number of at least 1, not {max_connections!r}")
    server = MetricsServer(cache, registry if registry is not None else registry_for(cache), admin, admin_token)
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    sockname = listener.extra(anyio.abc.SocketAttribute.local_address)
    server.host, server.port = str(sockname[0]), int(sockname[1])
    log.info("hicache metrics on %s/metrics%s", server.url, " (admin routes on)" if admin else "")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(serve_connections, listener, server.handle, tg, max_connections)
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
