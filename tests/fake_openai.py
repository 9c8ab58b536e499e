"""``FakeOpenAIServer``: a stand-in for a vLLM OpenAI server, on loopback, that records what it got.

A fake, named as such, for the proxy's tests (``test_pd_proxy``): it generates nothing. As a
``prefill`` server it answers with ``kv_transfer_params`` unique to each request (so a test can
check the proxy copied that very dict into the decode request); as a ``decode`` server it echoes the
``kv_transfer_params`` it received, as JSON or as a three-chunk SSE stream. Faults to inject:
``status`` (answer every request with that error status), ``stall`` (never answer),
``gate`` (a stream waits after its first chunk until the test opens it), ``die_mid_stream``.
``api_key``: like ``vllm serve --api-key``, every ``/v1`` route answers 401 without that bearer token.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeOpenAIServer:
    role: str  # "prefill" or "decode"
    name: str = "fake"
    status: int | None = None
    stall: bool = False
    die_mid_stream: bool = False
    gate: asyncio.Event | None = None
    gate_timeout_s: float = 10.0
    api_key: str | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)  # each request's headers (case-insensitive)
    url: str = ""
    _runner: web.AppRunner | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> FakeOpenAIServer:
        app = web.Application(middlewares=[self._authenticate], client_max_size=64 << 20)  # as vLLM: no 1 MiB cap
        for route in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(route, self._answer)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self._stopping.set()  # a stalled answer ends (the proxy gave up on it long ago)
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "owned_by": self.name}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append(request.headers.copy())
        if self.stall:
            await asyncio.wait_for(self._stopping.wait(), 60)
        if self.status is not None:
            return web.json_response({"error": {"message": f"{self.name} refuses", "code": self.status}},
                                     status=self.status)
        if self.role == "prefill":
            n = len(self.received)
            params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                      "remote_block_ids": [n, n + 1], "remote_host": "127.0.0.1", "remote_port": 7000 + n}
            return web.json_response({"id": f"{self.name}-{n}", "choices": [{"text": "p"}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "decoded"}], "server": self.name,
                                      "echo_kv": body.get("kv_transfer_params")})
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}], 'server': self.name})}\n\n".encode())
            if i == 0 and self.die_mid_stream:
                assert request.transport is not None
                request.transport.close()
                return response
            if i == 0 and self.gate is not None:
                await asyncio.wait_for(self.gate.wait(), self.gate_timeout_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
