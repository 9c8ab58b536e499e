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
(``prefill_timeout_s``), and each read of the decode answer (``read_timeout_s``, between chunks
of a stream). A prefill server that fails (unreachable, a 5xx, no answer in time, an answer that is
not JSON) is a **502** to the client naming the server, and the decode step is not started; a 4xx is
the client's own error and is passed on as it came. A prefill answer without ``kv_transfer_params``
(a server without a producer connector) is logged and the decode server recomputes the prompt: the
answer is the same, only slower. A decode server that fails before answering is a 502; one that
fails in the middle of a stream ends the stream with an ``error`` event. A client that goes away
cancels both upstream requests.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import ClientConnectionResetError, ClientError, ClientSession, ClientTimeout, web

__all__ = ["PDProxy", "ProxySettings", "build_app", "main"]

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


class UpstreamError(Exception):
    """A prefill or decode server failed; ``status`` is what the client gets (502, or the server's 4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class PDProxy:
    settings: ProxySettings
    _prefill: Any = field(init=False)
    _decode: Any = field(init=False)
    session: ClientSession | None = field(init=False, default=None)
    requests: int = field(init=False, default=0)
    without_kv: int = field(init=False, default=0)  # prefill answers without kv_transfer_params
    clients_gone: int = field(init=False, default=0)  # clients that closed during their answer

    def __post_init__(self) -> None:
        self._prefill = itertools.cycle(self.settings.prefill)
        self._decode = itertools.cycle(self.settings.decode)

    async def start(self, _app: web.Application | None = None) -> None:
        self.session = ClientSession(timeout=ClientTimeout(connect=self.settings.connect_timeout_s))

    async def close(self, _app: web.Application | None = None) -> None:
        if self.session is not None:
            await self.session.close()

    # -- the two steps ----------------------------------------------------------------------------

    async def prefill(self, route: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """Run the prompt on a prefill server; its ``kv_transfer_params`` (``None``: it gave none)."""
        assert self.session is not None
        server = next(self._prefill)
        request = copy.deepcopy(body)
        request["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
        request["stream"] = False
        request.pop("stream_options", None)
        request["max_tokens"] = 1
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        timeout = ClientTimeout(total=self.settings.prefill_timeout_s, connect=self.settings.connect_timeout_s)
        try:
            async with self.session.post(server + route, json=request, headers=headers, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    raise UpstreamError(502, f"prefill server {server} answered {resp.status}: {text[:500]}")
                if resp.status >= 400:
                    raise UpstreamError(resp.status, text)
                try:
                    answer = json.loads(text)
                except ValueError:
                    raise UpstreamError(502, f"prefill server {server} answered something that is not JSON") from None
        except TimeoutError:
            raise UpstreamError(
                502, f"prefill server {server} did not answer within {self.settings.prefill_timeout_s}s"
            ) from None
        except ClientError as exc:
            raise UpstreamError(502, f"prefill server {server} failed: {type(exc).__name__}: {exc}") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            self.without_kv += 1
            log.warning("prefill server %s returned no kv_transfer_params: the decode server recomputes", server)
            return None
        return params

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        headers.setdefault("X-Request-Id", f"pd-{uuid.uuid4().hex}")  # one id for both steps
        route = request.path
        try:
            params = await self.prefill(route, body, headers)
        except UpstreamError as exc:
            log.warning("%s", exc)
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
        server = next(self._decode)
        timeout = ClientTimeout(
            total=None, connect=self.settings.connect_timeout_s, sock_read=self.settings.read_timeout_s
        )
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(server + route, json=body, headers=headers, timeout=timeout) as resp:
                if resp.status >= 500:
                    text = await resp.text()
                    raise UpstreamError(502, f"decode server {server} answered {resp.status}: {text[:500]}")
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
            if isinstance(exc, UpstreamError):
                message = str(exc)
            elif isinstance(exc, TimeoutError):
                message = f"decode server {server} was silent for {self.settings.read_timeout_s}s"
            else:
                message = f"decode server {server} failed: {type(exc).__name__}: {exc}"
            log.warning("%s", message)
            if response is None:
                return _error(502, message)
            # The answer has begun: the status is sent. A stream ends with an error event.
            event = {"error": {"message": message, "type": "bad_gateway", "code": 502}}
            try:
                await _to_client(response, f"data: {json.dumps(event)}\n\n".encode())
            except ClientGone:
                return response
        try:
            await response.write_eof()
        except _CLIENT_WRITE_ERRORS:  # the client left after the last chunk
            self.clients_gone += 1
        return response

    async def models(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        server = next(self._decode)
        timeout = ClientTimeout(total=self.settings.connect_timeout_s + 30)
        try:
            async with self.session.get(server + "/v1/models", timeout=timeout) as resp:
                return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)
        except (TimeoutError, ClientError) as exc:
            return _error(502, f"decode server {server} failed: {type(exc).__name__}: {exc}")

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "prefill": list(self.settings.prefill),
                                  "decode": list(self.settings.decode), "requests": self.requests,
                                  "prefill_without_kv": self.without_kv, "clients_gone": self.clients_gone})


class ClientGone(Exception):
    """Writing to the client failed: it closed its connection."""


_CLIENT_WRITE_ERRORS = (ConnectionResetError, ClientConnectionResetError)


async def _to_client(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except _CLIENT_WRITE_ERRORS as exc:
        raise ClientGone from exc


def _error(status: int, message: str) -> web.Response:
    kind = "bad_gateway" if status == 502 else "invalid_request_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def build_app(settings: ProxySettings) -> tuple[web.Application, PDProxy]:
    proxy = PDProxy(settings)
    app = web.Application()
    for route in _ROUTES:
        app.router.add_post(route, proxy.handle)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.close)
    return app, proxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hicache pd-proxy",
        description="An OpenAI-compatible proxy for vLLM prefill/decode disaggregation: each request is "
        "prefilled on a prefill server (max_tokens=1), then decoded on a decode server with the "
        "prefill's kv_transfer_params; round robin over several servers of each kind.",
    )
    parser.add_argument("--prefill", required=True, help="prefill servers: http://host:port[,http://host:port...]")
    parser.add_argument("--decode", required=True, help="decode servers: http://host:port[,http://host:port...]")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--connect-timeout-s", type=float, default=10.0)
    parser.add_argument("--prefill-timeout-s", type=float, default=300.0, help="bound on the whole prefill step")
    parser.add_argument("--read-timeout-s", type=float, default=300.0, help="bound on each read of the decode answer")
    args = parser.parse_args(argv)
    try:
        settings = ProxySettings(
            server_urls(args.prefill), server_urls(args.decode), connect_timeout_s=args.connect_timeout_s,
            prefill_timeout_s=args.prefill_timeout_s, read_timeout_s=args.read_timeout_s,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if min(settings.connect_timeout_s, settings.prefill_timeout_s, settings.read_timeout_s) <= 0:
        parser.error("timeouts must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, _ = build_app(settings)
    print(f"hicache pd-proxy on http://{args.host}:{args.port}: prefill {', '.join(settings.prefill)}; "
          f"decode {', '.join(settings.decode)}", file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0
