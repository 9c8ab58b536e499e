"""``hicache pd-proxy`` against stand-in OpenAI servers (``FakeOpenAIServer``, which record what they got).

The real two-vLLM-server run belongs to the PD connector's tests; here: the two-step dispatch
(prefill with ``max_tokens=1``, ``stream=false`` and ``do_remote_decode``; decode with the prefill's
``kv_transfer_params``), streaming passed through chunk by chunk, round robin, and failures that
reach the client as clear errors within their bounds, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from aiohttp import ClientSession, ClientTimeout, web  # noqa: E402

from hicache.integrations.vllm.pd_proxy import PDProxy, ProxySettings, build_app, serve, server_urls  # noqa: E402

from .fake_openai import FakeOpenAIServer  # noqa: E402

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True}}


@asynccontextmanager
async def proxy_at(prefill: list[str], decode: list[str], **settings: Any) -> AsyncIterator[tuple[str, PDProxy]]:
    """The proxy over these servers, served as the command serves it (``serve``: with its connection caps)."""
    runner, _site, proxy = await serve(ProxySettings(prefill, decode, **settings), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", proxy
    finally:
        await runner.cleanup()


@asynccontextmanager
async def running_proxy(prefill: list[FakeOpenAIServer], decode: list[FakeOpenAIServer], **settings: Any
                        ) -> AsyncIterator[tuple[str, PDProxy]]:
    for fake in (*prefill, *decode):
        await fake.start()
    try:
        async with proxy_at([f.url for f in prefill], [f.url for f in decode], **settings) as (url, proxy):
            yield url, proxy
    finally:
        for fake in (*prefill, *decode):
            await fake.stop()


@asynccontextmanager
async def proxy_over(prefill: list[FakeOpenAIServer], decode: list[FakeOpenAIServer], **settings: Any
                     ) -> AsyncIterator[tuple[str, ClientSession]]:
    async with running_proxy(prefill, decode, **settings) as (url, _proxy):
        async with ClientSession(timeout=ClientTimeout(total=30)) as client:
            yield url, client


async def test_a_completion_is_prefilled_then_decoded_with_the_prefills_kv_transfer_params() -> None:
    prefill, decode = FakeOpenAIServer("prefill", "p0"), FakeOpenAIServer("decode", "d0")
    async with proxy_over([prefill], [decode]) as (url, client):
        async with client.post(url + "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer t"}) as r:
            assert r.status == 200
            answer = await r.json()
    (sent_prefill,), (sent_decode,) = prefill.received, decode.received
    assert sent_prefill["max_tokens"] == 1 and sent_prefill["stream"] is False
    assert sent_prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert sent_prefill["kv_transfer_params"]["do_remote_prefill"] is False
    assert sent_prefill["prompt"] == "hello"
    # The decode request is the client's own, with the prefill's answer's kv_transfer_params copied in.
    assert sent_decode["max_tokens"] == 16 and "stream" not in sent_decode
    assert sent_decode["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0", "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1", "remote_port": 7001,
    }
    assert answer["server"] == "d0" and answer["echo_kv"] == sent_decode["kv_transfer_params"]
    # Both steps carry the client's credentials and one request id.
    assert prefill.headers[0]["Authorization"] == decode.headers[0]["Authorization"] == "Bearer t"
    assert prefill.headers[0]["X-Request-Id"] == decode.headers[0]["X-Request-Id"] != ""


async def test_a_chat_stream_is_passed_through_chunk_by_chunk() -> None:
    """The first chunk reaches the client while the decode server still holds back the rest."""
    gate = asyncio.Event()
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode", gate=gate)
    async with proxy_over([prefill], [decode]) as (url, client):
        async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "t0"
            gate.set()  # only now does the decode server send the rest
            rest = (await asyncio.wait_for(r.content.read(), 10)).split(b"\n\n")
    assert [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in rest[:2]] == ["t1", "t2"]
    assert rest[2] == b"data: [DONE]"
    (sent_prefill,), (sent_decode,) = prefill.received, decode.received
    assert sent_prefill["stream"] is False and "stream_options" not in sent_prefill
    assert sent_prefill["max_tokens"] == sent_prefill["max_completion_tokens"] == 1
    assert sent_decode["stream"] is True and sent_decode["stream_options"] == {"include_usage": True}
    assert sent_decode["max_completion_tokens"] == 16 and sent_decode["kv_transfer_params"]["remote_block_ids"] == [1, 2]


async def test_requests_go_round_robin_over_each_kind_of_server() -> None:
    prefill = [FakeOpenAIServer("prefill", f"p{i}") for i in range(2)]
    decode = [FakeOpenAIServer("decode", f"d{i}") for i in range(3)]
    async with proxy_over(prefill, decode) as (url, client):
        served = []
        for _ in range(6):
            async with client.post(url + "/v1/completions", json=COMPLETION) as r:
                answer = await r.json()
                served.append((answer["echo_kv"]["remote_engine_id"], answer["server"]))
    assert served == [("p0", "d0"), ("p1", "d1"), ("p0", "d2"), ("p1", "d0"), ("p0", "d1"), ("p1", "d2")]
    assert [len(f.received) for f in prefill] == [3, 3] and [len(f.received) for f in decode] == [2, 2, 2]


async def test_a_failing_prefill_server_is_a_502_and_nothing_is_decoded() -> None:
    failing, decode = FakeOpenAIServer("prefill", "bad", status=500), FakeOpenAIServer("decode")
    async with proxy_over([failing], [decode]) as (url, client):
        async with client.post(url + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 502
            error = (await r.json())["error"]
    # The client learns which server by its place, never its (internal) URL: that is in the proxy's log.
    assert error["message"] == "prefill server 1 of 1 answered 500" and error["code"] == 502
    assert failing.url not in error["message"]
    assert decode.received == []


async def test_the_prefills_own_4xx_reaches_the_client_as_it_came() -> None:
    refusing, decode = FakeOpenAIServer("prefill", status=400), FakeOpenAIServer("decode")
    async with proxy_over([refusing], [decode]) as (url, client):
        async with client.post(url + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 400
    assert decode.received == []


async def test_a_stalled_prefill_server_is_a_504_within_its_bound() -> None:
    stalled, decode = FakeOpenAIServer("prefill", stall=True), FakeOpenAIServer("decode")
    async with proxy_over([stalled], [decode], prefill_timeout_s=0.5) as (url, client):
        started = time.monotonic()
        async with client.post(url + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 504
            assert (await r.json())["error"]["message"] == "prefill server 1 of 1 did not answer within 0.5s"
        assert time.monotonic() - started < 5
    assert decode.received == []


async def test_unreachable_servers_are_502s_that_do_not_name_them() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode")
    await prefill.start()
    await decode.start()
    try:
        for servers in (([dead], [decode.url]), ([prefill.url], [dead])):
            app, _ = build_app(ProxySettings(*servers, connect_timeout_s=2))
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            try:
                async with ClientSession() as client:
                    async with client.post(f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions",
                                           json=COMPLETION) as r:
                        message = (await r.json())["error"]["message"]
                        assert r.status == 502 and message.endswith("server 1 of 1 could not be reached")
                        assert dead not in message and dead.rsplit(":", 1)[1] not in message
            finally:
                await runner.cleanup()
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_decode_server_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode", die_mid_stream=True)
    async with proxy_over([prefill], [decode]) as (url, client):
        async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            events = (await asyncio.wait_for(r.content.read(), 10)).split(b"\n\n")
    assert json.loads(events[0].removeprefix(b"data: "))["choices"][0]["text"] == "t0"
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == 502


async def test_a_client_leaving_mid_stream_drops_the_decode_stream_and_the_next_request_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client closes after the first chunk; the decode server then sends the rest. The proxy
    counts the client gone, logs no error, drops that upstream connection half-read (never reused),
    and the next request through it gets its whole answer."""
    gate = asyncio.Event()
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode", gate=gate)
    await prefill.start()
    await decode.start()
    app, proxy = build_app(ProxySettings([prefill.url], [decode.url]))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with ClientSession(timeout=ClientTimeout(total=30)) as client:
            r = await client.post(url + "/v1/chat/completions", json=CHAT)
            assert r.status == 200
            await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            r.close()  # the client goes away with the answer half sent
            gate.set()  # the decode server sends the rest into a closed client
            deadline = time.monotonic() + 10
            while proxy.clients_gone == 0:
                assert time.monotonic() < deadline, "the proxy never noticed the client had gone"
                await asyncio.sleep(0.02)
            async with client.post(url + "/v1/chat/completions", json=CHAT) as again:
                events = (await asyncio.wait_for(again.content.read(), 10)).split(b"\n\n")
        assert [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in events[:3]] == ["t0", "t1", "t2"]
        assert events[3] == b"data: [DONE]"
        assert proxy.clients_gone == 1
        assert not [rec for rec in caplog.records if rec.levelname == "ERROR"], "a client leaving is not an error"
    finally:
        await runner.cleanup()
        await prefill.stop()
        await decode.stop()


def test_server_lists_and_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.cli import main

    assert server_urls("http://a:1, http://b:2/") == ["http://a:1", "http://b:2"]
    for bad in ("", "a:1", "http://a:99999"):
        with pytest.raises(ValueError):
            server_urls(bad)
    for argv, complaint in ((["--prefill", "http://a:1"], "--decode"),
                            (["--prefill", "ftp://a:1", "--decode", "http://b:2"], "ftp://a:1"),
                            (["--prefill", "http://a:1", "--decode", "http://b:2", "--max-in-flight", "0"], ">= 1"),
                            (["--prefill", "http://a:1", "--decode", "http://b:2", "--trusted-proxy", "x"], "'x'")):
        with pytest.raises(SystemExit) as exit_:
            main(["pd-proxy", *argv])
        assert exit_.value.code == 2 and complaint in capsys.readouterr().err
