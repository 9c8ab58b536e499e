"""``hicache pd-proxy``: an OpenAI-compatible proxy in front of vLLM prefill and decode servers.

Prefill/decode disaggregation in vLLM is driven from outside the servers: for each request the
proxy

1. sends it to a **prefill** server (round robin) with ``max_tokens=1``, ``stream=false`` and
   ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false, ...}``: the server
   computes the prompt's KV, hands it to its KV connector (a producer) and answers with the
   ``kv_transfer_params`` a consumer needs to find that KV;
2. sends the original request to a **decode** server (round robin), with those
   ``kv_transfer_params``, and streams its answer back to the client as it comes.

Both ``/v1/completions`` and ``/v1/chat/completions``, streaming or not; ``/v1/models`` is
answered by a decode server, ``/health`` by the proxy itself. It lives under the vLLM integration
because the protocol (``kv_transfer_params``) is vLLM's; it imports no vLLM, only aiohttp (server
and client in one library, already in vLLM's environment; the ``pd`` extra elsewhere).

**Every wait is bounded**: connecting (``connect_timeout_s``), the whole prefill step
(``prefill_timeout_s``), each read of the decode answer (``read_timeout_s``, between chunks of a
stream), the client's body (``body_timeout_s``: **408**). **Every resource is capped**
(``pd_proxy_limits``): requests in flight in total (**503**) and per client (**429**), both at once
with ``Retry-After``; the upstream connection pool (as large as the in-flight cap unless set, so a
request let in never waits for one); client connections; the body's size (**413** naming
``--max-body-mb``). **Failures say what they were**, naming a server by its place ("prefill server 2
of 3", its URL only in the log): unreachable or failing is a **502**, silent past its bound a
**504**, the proxy's own pool full a **503**; a 4xx is the client's own error, passed on as it came.
A prefill answer without ``kv_transfer_params`` (a server without a producer connector) is logged and
the decode server recomputes the prompt. A decode server that fails in the middle of a stream ends
it with an ``error`` event. A client that goes away cancels both upstream requests.
"""

from __future__ import annotations

import asyncio
import copy
import io
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from aiohttp import (
    ClientConnectionResetError,
    ClientConnectorError,
    ClientError,
    ClientSession,
    ClientTimeout,
    BytesIOPayload,
    ConnectionTimeoutError,
    SocketTimeoutError,
    TCPConnector,
    TraceConfig,
    web,
)

from .pd_proxy_limits import CappedSite, InFlight, client_address, parse_networks

__all__ = ["PDProxy", "ProxySettings", "build_app", "serve", "server_urls"]

log = logging.getLogger(__name__)

#: What the prefill request carries: vLLM's producer is to keep the KV for a remote decode.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_FORWARDED_HEADERS = ("authorization", "x-request-id")
_ROUTES = ("/v1/completions", "/v1/chat/completions")
_MIB = 1 << 20


def server_urls(text: str) -> list[str]:
    """``http://host:port[,...]`` -> the base URLs, without a trailing slash; ``ValueError`` for a bad one."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError("at least one server URL")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected http(s)://host:port, got {url!r}")
        try:
            parts.port  # noqa: B018 - raises for a port out of range
        except ValueError:
            raise ValueError(f"bad port in {url!r}") from None
    return urls


@dataclass(frozen=True)
class ProxySettings:
    prefill: Sequence[str]
    decode: Sequence[str]
    connect_timeout_s: float = 10.0
    #: The whole prefill step: the prompt's computation and its KV handed to the producer.
    prefill_timeout_s: float = 300.0
    #: Each read of the decode server's answer (for a stream: the longest gap between two chunks).
    read_timeout_s: float = 300.0
    #: Requests in flight, all clients together (over it: 503) and from one client (over it: 429).
    max_in_flight: int = 512
    max_in_flight_per_client: int = 128
    #: The upstream connection pool (prefill and decode servers together); 0: ``max_in_flight``.
    upstream_connections: int = 0
    #: Open client connections, in total and from one address (over it: a 503, closed).
    max_connections: int = 1024
    max_connections_per_client: int = 256
    #: The largest request body (a 200k-token prompt is 1-2 MiB of JSON) and the time to receive it.
    max_body_mb: float = 16.0
    body_timeout_s: float = 30.0
    #: Peers (addresses or CIDRs) whose ``X-Forwarded-For`` names the client; none by default.
    trusted_proxies: tuple[str, ...] = ()

    @property
    def pool_size(self) -> int:
        return self.upstream_connections or self.max_in_flight

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * _MIB)

    def check(self) -> None:
        """``ValueError`` for a setting out of range."""
        if min(self.connect_timeout_s, self.prefill_timeout_s, self.read_timeout_s, self.body_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if min(self.max_in_flight, self.max_in_flight_per_client, self.max_connections,
               self.max_connections_per_client) < 1 or self.upstream_connections < 0 or self.max_body_mb <= 0:
            raise ValueError("caps must be >= 1 (--upstream-connections >= 0, --max-body-mb > 0)")
        parse_networks(self.trusted_proxies)


@dataclass(frozen=True)
class Upstream:
    """One server; clients learn its kind and place, never its URL (that is in the log)."""

    kind: str
    index: int
    of: int
    url: str

    def __str__(self) -> str:
        return f"{self.kind} server {self.index + 1} of {self.of}"


class UpstreamError(Exception):
    """A server failed, or the proxy could not reach it; ``status`` is what the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _round_robin(kind: str, urls: Sequence[str]) -> Callable[[], Upstream]:
    servers = [Upstream(kind, i, len(urls), url) for i, url in enumerate(urls)]
    turn = iter(range(1 << 62))
    return lambda: servers[next(turn) % len(servers)]


async def _queued(_s: ClientSession, ctx: SimpleNamespace, _p: Any) -> None:
    ctx.trace_request_ctx.queued = True


async def _dequeued(_s: ClientSession, ctx: SimpleNamespace, _p: Any) -> None:
    ctx.trace_request_ctx.queued = False


@dataclass
class PDProxy:
    settings: ProxySettings
    _prefill: Callable[[], Upstream] = field(init=False)
    _decode: Callable[[], Upstream] = field(init=False)
    session: ClientSession | None = field(init=False, default=None)
    in_flight: InFlight = field(init=False)
    requests: int = field(init=False, default=0)
    without_kv: int = field(init=False, default=0)  # prefill answers without kv_transfer_params
    clients_gone: int = field(init=False, default=0)  # clients that closed during their answer

    def __post_init__(self) -> None:
        self._prefill = _round_robin("prefill", self.settings.prefill)
        self._decode = _round_robin("decode", self.settings.decode)
        self.in_flight = InFlight(self.settings.max_in_flight, self.settings.max_in_flight_per_client)
        self._trusted = parse_networks(self.settings.trusted_proxies)

    async def start(self, _app: web.Application | None = None) -> None:
        # The pool is as large as the in-flight cap (unless set): a request let in never waits for a
        # connection. One host may take it all: round robin does not follow load, and a slow decode
        # server holding most streams must not make the others' requests wait.
        trace = TraceConfig()
        trace.on_connection_queued_start.append(_queued)
        trace.on_connection_queued_end.append(_dequeued)
        size = self.settings.pool_size
        self.session = ClientSession(
            connector=TCPConnector(limit=size, limit_per_host=size), trace_configs=[trace],
            timeout=ClientTimeout(connect=self.settings.connect_timeout_s,
                                  sock_connect=self.settings.connect_timeout_s),
        )

    async def close(self, _app: web.Application | None = None) -> None:
        if self.session is not None:
            await self.session.close()

    def _failure(self, server: Upstream, exc: BaseException, ctx: SimpleNamespace, bound: str) -> UpstreamError:
        """What ``exc`` was, as the client's answer; the server's URL and the details go to the log."""
        s = self.settings
        if isinstance(exc, TimeoutError) and ctx.queued:
            error = UpstreamError(503, f"the proxy's {s.pool_size} upstream connections are all in use: none free "
                                       f"within {s.connect_timeout_s}s (raise --upstream-connections)")
        elif isinstance(exc, ConnectionTimeoutError):
            error = UpstreamError(504, f"{server}: no connection within {s.connect_timeout_s}s")
        elif isinstance(exc, SocketTimeoutError):
            error = UpstreamError(504, f"{server} was silent for {s.read_timeout_s}s")
        elif isinstance(exc, TimeoutError):
            error = UpstreamError(504, f"{server} did not answer within {bound}")
        elif isinstance(exc, ClientConnectorError):
            error = UpstreamError(502, f"{server} could not be reached")
        else:
            error = UpstreamError(502, f"{server} failed ({type(exc).__name__})")
        log.warning("%s [%s: %s: %s]", error, server.url, type(exc).__name__, exc)
        return error

    def _answered(self, server: Upstream, status: int, text: str) -> UpstreamError:
        log.warning("%s (%s) answered %d: %s", server, server.url, status, text[:500])
        return UpstreamError(502, f"{server} answered {status}")

    # -- the two steps ----------------------------------------------------------------------------

    async def prefill(self, route: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """Run the prompt on a prefill server; its ``kv_transfer_params`` (``None``: it gave none)."""
        assert self.session is not None
        server = self._prefill()
        request = copy.deepcopy(body)
        request["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
        request["stream"] = False
        request.pop("stream_options", None)
        request["max_tokens"] = 1
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        s = self.settings
        timeout = ClientTimeout(total=s.prefill_timeout_s, connect=s.connect_timeout_s,
                                sock_connect=s.connect_timeout_s)
        ctx = SimpleNamespace(queued=False)
        try:
            async with self.session.post(server.url + route, data=_json(request), headers=headers, timeout=timeout,
                                         trace_request_ctx=ctx) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    raise self._answered(server, resp.status, text)
                if resp.status >= 400:
                    raise UpstreamError(resp.status, text)
                try:
                    answer = json.loads(text)
                except ValueError:
                    log.warning("%s (%s) answered something that is not JSON: %r", server, server.url, text[:200])
                    raise UpstreamError(502, f"{server} answered something that is not JSON") from None
        except (TimeoutError, ClientError) as exc:
            raise self._failure(server, exc, ctx, f"{s.prefill_timeout_s}s") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            self.without_kv += 1
            log.warning("%s (%s) returned no kv_transfer_params: the decode server recomputes", server, server.url)
            return None
        return params

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        s = self.settings
        if request.content_length is not None and request.content_length > s.max_body_bytes:
            return _too_large(s, request.content_length)
        try:
            async with asyncio.timeout(s.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            # Answered, then our side of the connection is shut (the client reads the 408, then an
            # end): aiohttp reads what still trickles in for at most its lingering time, then closes.
            response = _error(408, f"the request body did not arrive within {s.body_timeout_s}s (--body-timeout-s)")
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None and request.transport.can_write_eof():
                request.transport.write_eof()
            return response
        except web.HTTPRequestEntityTooLarge:
            return _too_large(s, None)
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = _forwarded(request)
        route = request.path
        try:
            params = await self.prefill(route, body, headers)
        except UpstreamError as exc:
            return _error(exc.status, str(exc))
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        else:
            decode_body.pop("kv_transfer_params", None)
        return await self.decode(request, route, decode_body, headers)

    async def decode(
        self, request: web.Request, route: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """Send the request to a decode server and pass its answer through, chunk by chunk."""
        assert self.session is not None
        server = self._decode()
        s = self.settings
        timeout = ClientTimeout(total=None, connect=s.connect_timeout_s, sock_connect=s.connect_timeout_s,
                                sock_read=s.read_timeout_s)
        ctx = SimpleNamespace(queued=False)
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(server.url + route, data=_json(body), headers=headers, timeout=timeout,
                                         trace_request_ctx=ctx) as resp:
                if resp.status >= 500:
                    raise self._answered(server, resp.status, await resp.text())
                response = web.StreamResponse(status=resp.status)
                response.content_type = resp.content_type
                if resp.charset:
                    response.charset = resp.charset
                await response.prepare(request)
                try:
                    async for chunk in resp.content.iter_any():
                        await _to_client(response, chunk)
                except ClientGone:
                    # The client left mid-answer: drop the decode server's stream (its connection is
                    # closed, never reused half-read; vLLM aborts the request) and end quietly.
                    resp.close()
                    self.clients_gone += 1
                    log.info("a client left during the answer from %s: its request ends there", server)
                    return response
        except (TimeoutError, ClientError, UpstreamError) as exc:
            error = exc if isinstance(exc, UpstreamError) else self._failure(server, exc, ctx, "its bound")
            if response is None:
                return _error(error.status, str(error))
            # The answer has begun: the status is sent. A stream ends with an error event.
            event = {"error": {"message": str(error), "type": _KINDS.get(error.status, "bad_gateway"),
                               "code": error.status}}
            try:
                await _to_client(response, f"data: {json.dumps(event)}\n\n".encode())
            except ClientGone:
                return response
        try:
            await response.write_eof()
        except _CLIENT_WRITE_ERRORS:  # the client left after the last chunk
            self.clients_gone += 1
        return response

    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        server = self._decode()
        timeout = ClientTimeout(total=self.settings.connect_timeout_s + 30)
        ctx = SimpleNamespace(queued=False)
        try:
            async with self.session.get(server.url + "/v1/models", headers=_forwarded(request), timeout=timeout,
                                        trace_request_ctx=ctx) as resp:
                if resp.status >= 500:
                    error = self._answered(server, resp.status, await resp.text())
                    return _error(error.status, str(error))
                return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)
        except (TimeoutError, ClientError) as exc:
            error = self._failure(server, exc, ctx, f"{timeout.total}s")
            return _error(error.status, str(error))

    async def health(self, _request: web.Request) -> web.Response:
        """The proxy's own state; the servers by count (their URLs are no client's business)."""
        return web.json_response({
            "status": "ok", "prefill": len(self.settings.prefill), "decode": len(self.settings.decode),
            "requests": self.requests, "in_flight": self.in_flight.now, "prefill_without_kv": self.without_kv,
            "clients_gone": self.clients_gone, "refused": {str(k): v for k, v in self.in_flight.refused.items()},
        })

    @web.middleware
    async def admit(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Count a request in, or refuse it at once (before its body is read) when over a cap."""
        if request.path == "/health":
            return await handler(request)
        client = client_address(request.remote, request.headers.get("X-Forwarded-For"), self._trusted)
        refused = self.in_flight.enter(client)
        if refused == 429:
            return _error(429, f"too many requests in flight from this client (at most "
                               f"{self.settings.max_in_flight_per_client})")
        if refused == 503:
            return _error(503, f"the proxy is at its cap of {self.settings.max_in_flight} requests in flight")
        try:
            return await handler(request)
        finally:
            self.in_flight.leave(client)


class ClientGone(Exception):
    """Writing to the client failed: it closed its connection."""


_CLIENT_WRITE_ERRORS = (ConnectionResetError, ClientConnectionResetError)
_KINDS = {408: "timeout", 413: "invalid_request_error", 429: "rate_limit_exceeded", 502: "bad_gateway",
          503: "overloaded", 504: "gateway_timeout"}


async def _to_client(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except _CLIENT_WRITE_ERRORS as exc:
        raise ClientGone from exc


def _json(body: dict[str, Any]) -> BytesIOPayload:
    """A request body as a stream of bytes (a long prompt is megabytes: aiohttp writes it in pieces)."""
    return BytesIOPayload(io.BytesIO(json.dumps(body).encode()), content_type="application/json")


def _forwarded(request: web.Request) -> dict[str, str]:
    """The client's ``Authorization`` and ``X-Request-Id`` (a new one if none: one id for both steps)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
    if not any(k.lower() == "x-request-id" for k in headers):
        headers["X-Request-Id"] = f"pd-{uuid.uuid4().hex}"
    return headers


def _error(status: int, message: str) -> web.Response:
    """An OpenAI-shaped error; a refusal for load (429, 503) says to come back in a second."""
    kind = _KINDS.get(status, "invalid_request_error")
    response = web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
    if status in (429, 503):
        response.headers["Retry-After"] = "1"
    return response


def _too_large(settings: ProxySettings, size: int | None) -> web.Response:
    got = f" ({size} bytes)" if size is not None else ""
    response = _error(413, f"the request body{got} is larger than this proxy's cap of {settings.max_body_mb:g} MiB: "
                           f"raise it with --max-body-mb")
    response.force_close()  # the body is not read
    return response


def build_app(settings: ProxySettings) -> tuple[web.Application, PDProxy]:
    settings.check()
    proxy = PDProxy(settings)
    # client_max_size: aiohttp's own check, for bodies without a Content-Length (chunked).
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[proxy.admit])
    for route in _ROUTES:
        app.router.add_post(route, proxy.handle)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.close)
    return app, proxy


async def serve(settings: ProxySettings, host: str, port: int) -> tuple[web.AppRunner, CappedSite, PDProxy]:
    """Start the proxy on ``host:port`` with its connection caps; ``runner.cleanup()`` stops it."""
    app, proxy = build_app(settings)
    # lingering_time: a body answered without being read (a 413, 429, 503) is drained for at most
    # 2 s, not aiohttp's 10, before the connection closes: a slot is not held by a body refused.
    runner = web.AppRunner(app, shutdown_timeout=10, lingering_time=2.0)
    await runner.setup()
    site = CappedSite(runner, host, port, max_connections=settings.max_connections,
                      max_per_client=settings.max_connections_per_client)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site, proxy
