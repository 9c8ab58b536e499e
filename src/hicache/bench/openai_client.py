"""A streaming client of an OpenAI-compatible completions endpoint, timed at the client.

``CompletionsClient.generate`` has the shape ``driver.drive`` expects of an engine (``Request`` in,
``RequestResult`` out), so the multi-turn and long-context drivers run unchanged against a server
over HTTP, as SGLang's ``bench_serving`` measures one: TTFT is from just before the request is sent
to the first streamed token, inter-token latencies are the gaps between streamed tokens (a chunk
carrying several tokens gives them all its arrival time). Prompts go as token ids and outputs
come back as token ids (vLLM's ``return_token_ids``), greedy, ``ignore_eos``, so every turn is
exactly the trace's. From the final usage chunk: the prompt length, the tokens the server did not
compute (``prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``), and,
with ``--enable-per-request-metrics``, vLLM's own queue time and prefill time for the breakdown.

Each request carries ``X-Request-Id`` (``request_id(tags)``), which vLLM uses in its request id,
so the connector's per-request load records can be matched to it afterwards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ..engine import Request, RequestResult

__all__ = ["CompletionsClient", "RequestFailed", "request_id"]


class RequestFailed(RuntimeError):
    """The server answered a request with an error, or the stream ended without a token."""


def request_id(prefix: str, tags: Mapping[str, Any]) -> str:
    """The ``X-Request-Id`` of a benchmark request: unique per conversation and round."""
    return f"{prefix}c{tags['conversation']}r{tags['round']}x"


class CompletionsClient:
    """Sends ``Request``s to ``{url}/v1/completions`` as streamed, greedy completions."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        id_prefix: str = "hcb-",
        timeout_s: float = 900.0,
        clock: Callable[[], float] = time.perf_counter,
        max_connections: int = 64,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.id_prefix = id_prefix
        self.timeout_s = timeout_s
        self.clock = clock
        self.max_connections = max_connections
        self.extra_body = dict(extra_body or {})
        self._session: Any = None

    async def __aenter__(self) -> CompletionsClient:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def body(self, request: Request) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(request.tokens),
            "max_tokens": request.max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            **self.extra_body,
        }

    async def generate(self, request: Request) -> RequestResult:
        """One streamed completion; raises ``RequestFailed`` on an HTTP error or an empty stream."""
        assert self._session is not None, "use `async with CompletionsClient(...)`"
        rid = request_id(self.id_prefix, request.tags)
        output: list[int] = []
        times: list[float] = []
        usage: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        arrival = self.clock()
        async with self._session.post(f"{self.url}/v1/completions", json=self.body(request),
                                      headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                raise RequestFailed(f"{rid}: HTTP {resp.status}: {(await resp.text())[:500]}")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RequestFailed(f"{rid}: {chunk['error']}")
                now = self.clock()
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or ()
                    output.extend(int(t) for t in ids)
                    times.extend([now] * len(ids))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("metrics"):
                    metrics = chunk["metrics"]
        if not output:
            raise RequestFailed(f"{rid}: the stream ended without a token")
        queue_s = float(metrics.get("queue_time_ms") or 0.0) / 1e3
        stages = {"client_ttft": times[0] - arrival}
        if metrics.get("time_to_first_token_ms") is not None:
            stages["server_queue"] = queue_s
            stages["server_prefill"] = float(metrics["time_to_first_token_ms"]) / 1e3
        details = usage.get("prompt_tokens_details") or {}
        return RequestResult(
            request=request,
            output=tuple(output),
            arrival_s=arrival,
            admitted_s=arrival + queue_s,
            token_times=tuple(times),
            prompt_tokens=int(usage.get("prompt_tokens") or len(request.tokens)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            by_tier=MappingProxyType({}),
            stages=MappingProxyType(stages),
        )
