"""``hicache pd-proxy`` under load and abuse: caps on requests in flight, the upstream pool, connections,
bodies (size and time), and what a client may learn (issue #50, items 2, 6, 10, 11).

All through the real proxy on loopback, in front of stand-in servers (``FakeOpenAIServer``) that hold
their streams open; clients come from different loopback addresses (127.0.0.2, 127.0.0.3) to be
different clients. The slow-body flood runs the command itself, in a process with a small file
descriptor limit, as an operator would meet it.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from aiohttp import ClientSession, ClientTimeout, TCPConnector  # noqa: E402

from hicache.integrations.vllm.pd_proxy_limits import (  # noqa: E402
    RateLimitedLog,
    client_address,
    parse_networks,
    quiet_exception_handler,
)

from .fake_openai import FakeOpenAIServer  # noqa: E402
from .test_pd_proxy import CHAT, COMPLETION, proxy_at, running_proxy  # noqa: E402


def client_from(address: str) -> ClientSession:
    """A client whose connections come from ``address`` (any 127.x.y.z is this machine's loopback)."""
    return ClientSession(connector=TCPConnector(limit=0, local_addr=(address, 0)), timeout=ClientTimeout(total=60))


async def stream(client: ClientSession, url: str, gate: asyncio.Event, **headers: str) -> tuple[int, float, str]:
    """One chat stream: its status, the seconds until the status came, and (served) the events after the gate."""
    started = time.monotonic()
    async with client.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
        took = time.monotonic() - started
        if r.status != 200:
            assert r.headers.get("Retry-After") == "1", "a refusal says when to come back"
            return r.status, took, (await r.json())["error"]["message"]
        first = await r.content.readuntil(b"\n\n")
        await gate.wait()
        return r.status, took, (first + await r.content.read()).decode()


async def test_300_streams_are_each_served_or_refused_at_once_and_one_client_cannot_starve_the_others() -> None:
    """Client A opens 150 streams (100 served and held open, 50 a 429 at once), client B 100 more (all
    served: A's 100 do not starve it), client C 50 more (the total cap of 200 is reached: a 503 at
    once). None is a 502; every refusal comes within a second or two, not after a timeout."""
    gate = asyncio.Event()
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode", gate=gate, gate_timeout_s=60)
    started = time.monotonic()
    async with running_proxy([prefill], [decode], max_in_flight=200, max_in_flight_per_client=100,
                             connect_timeout_s=2) as (url, proxy):
        async with client_from("127.0.0.1") as a, client_from("127.0.0.2") as b, client_from("127.0.0.3") as c:
            held: list[asyncio.Task[tuple[int, float, str]]] = []

            async def wave(client: ClientSession, n: int, served: int) -> list[tuple[int, float, str]]:
                tasks = [asyncio.create_task(stream(client, url, gate)) for _ in range(n)]
                deadline = time.monotonic() + 30
                while sum(t.done() for t in tasks) < n - served or proxy.in_flight.now < len(held) + served:
                    assert time.monotonic() < deadline, "the wave never settled"
                    await asyncio.sleep(0.02)
                held.extend(t for t in tasks if not t.done())
                return [t.result() for t in tasks if t.done()]

            refused_a = await wave(a, 150, served=100)
            refused_b = await wave(b, 100, served=100)
            refused_c = await wave(c, 50, served=0)
            assert len(held) == 200 and proxy.in_flight.now == 200
            gate.set()
            served = await asyncio.gather(*held)
            # The streams are over: their slots are free again, for C too.
            assert proxy.in_flight.now == 0 and proxy.in_flight.clients == {}
            assert (await stream(c, url, gate))[0] == 200
    assert [r[0] for r in refused_a] == [429] * 50 and refused_b == [] and [r[0] for r in refused_c] == [503] * 50
    assert "at most 100" in refused_a[0][2] and "cap of 200" in refused_c[0][2]
    assert max(r[1] for r in refused_a + refused_c) < 2.0, "a refusal is answered at once"
    assert all(status == 200 and text.endswith("data: [DONE]\n\n") for status, _, text in served)
    assert proxy.in_flight.refused == {429: 50, 503: 50}
    print(f"300 streams through the proxy in {time.monotonic() - started:.2f}s")


async def test_a_full_upstream_pool_a_server_that_never_accepts_and_a_silent_one_are_each_named_for_what_they_are(
) -> None:
    """The pool's own exhaustion is a 503 that says so; a server that never accepts a connection is a
    504 "no connection"; a decode server silent past its bound a 504 "silent". None is a 502."""
    gate = asyncio.Event()
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode", gate=gate)
    async with running_proxy([prefill], [decode], upstream_connections=1, connect_timeout_s=0.5) as (url, _):
        async with client_from("127.0.0.1") as client:
            holder = asyncio.create_task(stream(client, url, gate))  # its decode stream holds the one connection
            while not decode.received:
                await asyncio.sleep(0.02)
            started = time.monotonic()
            status, _took, message = await stream(client, url, gate)
            assert time.monotonic() - started < 3
            gate.set()
            assert (await holder)[0] == 200
    assert status == 503 and "1 upstream connections are all in use" in message
    assert "--upstream-connections" in message

    with socket.socket() as blackhole:  # a listening socket whose queue is full: connecting to it hangs
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(0)
        fillers: list[socket.socket] = []
        try:
            while True:
                filler = socket.socket()
                filler.settimeout(0.2)
                fillers.append(filler)
                try:
                    filler.connect(blackhole.getsockname())
                except TimeoutError:
                    break
                assert len(fillers) < 16, "the listening queue never filled"
            hole = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
            good, stalled = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode", stall=True)
            await good.start()
            await stalled.start()
            try:
                cases = (([hole], [stalled.url], "prefill server 1 of 1: no connection within 0.5s"),
                         ([good.url], [stalled.url], "decode server 1 of 1 was silent for 0.5s"))
                for prefill_urls, decode_urls, expected in cases:
                    async with proxy_at(prefill_urls, decode_urls, connect_timeout_s=0.5, read_timeout_s=0.5) as (
                        url, _
                    ), ClientSession(timeout=ClientTimeout(total=10)) as client:
                        async with client.post(url + "/v1/completions", json=COMPLETION) as r:
                            assert (r.status, (await r.json())["error"]["message"]) == (504, expected)
            finally:
                await good.stop()
                await stalled.stop()
        finally:
            for filler in fillers:
                filler.close()


async def test_x_forwarded_for_is_believed_only_from_a_trusted_proxy() -> None:
    """A client at its cap cannot get more by writing ``X-Forwarded-For``; behind a trusted proxy the
    header names the client (its nearest untrusted hop: what a client writes to its left is ignored)."""
    gate = asyncio.Event()
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode", gate=gate)
    # Each stream is held open until the gate: one in flight per client at most.
    forwarded = ("", "10.9.9.9", "6.6.6.6, 10.9.9.9, 127.0.0.5")  # the third: 10.9.9.9 again, via a trusted hop
    for trusted, expected in (((), [200, 429, 429]), (("127.0.0.0/8",), [200, 200, 429])):
        async with running_proxy([prefill], [decode], max_in_flight_per_client=1, trusted_proxies=trusted) as (
            url, proxy
        ), client_from("127.0.0.1") as client:
            tasks = []
            for header in forwarded:
                tasks.append(asyncio.create_task(stream(client, url, gate, **({"X-Forwarded-For": header}
                                                                             if header else {}))))
                while not tasks[-1].done() and proxy.in_flight.now < sum(not t.done() for t in tasks):
                    await asyncio.sleep(0.02)
            gate.set()
            statuses = [status for status, _, _ in await asyncio.gather(*tasks)]
            gate.clear()
        assert statuses == expected, trusted
    nets = parse_networks(["127.0.0.1", "10.0.0.0/8"])
    assert client_address("127.0.0.1", "6.6.6.6, 1.2.3.4", ()) == "127.0.0.1"  # nobody trusted: the peer
    assert client_address("127.0.0.1", "6.6.6.6, 1.2.3.4", nets) == "1.2.3.4"  # the nearest hop, not the spoofable one
    assert client_address("127.0.0.1", "1.2.3.4, 10.1.1.1", nets) == "1.2.3.4"  # trusted hops skipped
    assert client_address("192.0.2.1", "1.2.3.4", nets) == "192.0.2.1"  # an untrusted peer's header is ignored
    assert client_address("127.0.0.1", "not-an-ip", nets) == "127.0.0.1"


async def raw_connection(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 5)


async def answer_of(reader: asyncio.StreamReader, within_s: float = 5) -> bytes:
    """What the server sent until it closed (an empty answer: closed without a word)."""
    try:
        return await asyncio.wait_for(reader.read(), within_s)
    except ConnectionResetError:
        return b"<reset>"


async def test_connections_are_capped_in_total_and_per_address() -> None:
    """Over a cap, a connection is answered 503 and closed at once; one closing makes room again."""
    opened: list[asyncio.StreamWriter] = []

    async def connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await raw_connection(port, source)
        opened.append(writer)
        return reader, writer

    async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return await answer_of(reader)

    async with proxy_at(["http://127.0.0.1:1"], ["http://127.0.0.1:1"], max_connections=4,
                        max_connections_per_client=2) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        try:
            first = [await connect("127.0.0.1") for _ in range(2)]
            assert (await answer_of((await connect("127.0.0.1"))[0])).startswith(b"HTTP/1.1 503")  # it has two
            second = [await connect("127.0.0.2") for _ in range(2)]
            assert (await answer_of((await connect("127.0.0.3"))[0])).startswith(b"HTTP/1.1 503")  # four in all
            # Those open are served; one closing makes room for another address.
            assert b'"status": "ok"' in await health(*second[1])
            await asyncio.sleep(0.1)
            assert b'"status": "ok"' in await health(*await connect("127.0.0.3"))
            assert b'"status": "ok"' in await health(*first[0])
        finally:
            for writer in opened:
                writer.close()


async def test_a_body_trickled_byte_by_byte_is_a_408_within_its_deadline() -> None:
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode")
    async with running_proxy([prefill], [decode], body_timeout_s=1) as (url, _):
        reader, writer = await raw_connection(int(url.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        started = time.monotonic()

        async def trickle() -> None:
            for _ in range(100):
                writer.write(b" ")
                await asyncio.sleep(0.1)

        dripping = asyncio.create_task(trickle())
        try:
            answer = await answer_of(reader, within_s=5)
        finally:
            dripping.cancel()
            writer.close()
        took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"did not arrive within 1" in answer and b"--body-timeout-s" in answer
    assert 0.9 < took < 3, took
    assert prefill.received == []


async def test_the_body_cap_fits_a_long_prompt_and_over_it_the_413_names_the_cap_and_its_flag() -> None:
    """A 3 MiB prompt (a 200k-token request is 1-2 MiB of JSON) passes by default; over a cap set
    lower, the 413 says which cap and which flag raises it, with a Content-Length or chunked."""
    prefill, decode = FakeOpenAIServer("prefill"), FakeOpenAIServer("decode")
    long_prompt = {**COMPLETION, "prompt": "word " * (600 * 1024)}
    async with running_proxy([prefill], [decode]) as (url, _), ClientSession() as client:
        async with client.post(url + "/v1/completions", data=io.BytesIO(json.dumps(long_prompt).encode())) as r:
            assert r.status == 200, await r.text()
    assert len(decode.received[-1]["prompt"]) == 5 * 600 * 1024

    async def chunked() -> Any:
        data = json.dumps(long_prompt).encode()
        for i in range(0, len(data), 1 << 16):
            yield data[i:i + (1 << 16)]

    async with running_proxy([prefill], [decode], max_body_mb=1) as (url, _), ClientSession() as client:
        for body in (io.BytesIO(json.dumps(long_prompt).encode()), chunked()):
            async with client.post(url + "/v1/completions", data=body) as r:
                assert r.status == 413
                message = (await r.json())["error"]["message"]
                assert "cap of 1 MiB" in message and "--max-body-mb" in message, message


async def test_health_and_errors_name_no_upstream_and_models_passes_the_clients_credentials() -> None:
    """``/health`` counts the servers and tells nothing of where they are; ``/v1/models`` reaches a
    server started with an API key (``vllm serve --api-key``) with the client's own ``Authorization``."""
    prefill = FakeOpenAIServer("prefill", api_key="s3cret")
    decode = FakeOpenAIServer("decode", api_key="s3cret")
    async with running_proxy([prefill], [decode]) as (url, _), ClientSession() as client:
        async with client.get(url + "/health") as r:
            text = await r.text()
            health = json.loads(text)
        async with client.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake-model"
        async with client.get(url + "/v1/models") as r:
            assert r.status == 401  # the server's own answer: the proxy adds no credentials of its own
        async with client.post(url + "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer s3cret"}
                               ) as r:
            assert r.status == 200
    assert health["prefill"] == 1 and health["decode"] == 1 and health["status"] == "ok"
    for fake in (prefill, decode):
        assert fake.url not in text and fake.url.rsplit(":", 1)[1] not in text
    assert decode.headers[0]["Authorization"] == "Bearer s3cret"


def test_the_event_loops_errors_are_logged_a_few_lines_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    """A thousand failing ``accept()`` calls in a burst are three lines, then one with the count."""
    now = [0.0]
    handler = quiet_exception_handler(RateLimitedLog(interval_s=10, burst=3, clock=lambda: now[0]))
    loop = asyncio.new_event_loop()
    try:
        loop.set_exception_handler(handler)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})
            assert len(caplog.records) == 3
            now[0] = 11.0
            loop.call_exception_handler({"message": "socket.accept() out of system resource"})
    finally:
        loop.close()
    assert len(caplog.records) == 4 and "997 more not logged" in caplog.records[-1].getMessage()


def _small_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (384, 384))


async def test_300_trickling_connections_leave_health_answering_and_the_log_small(tmp_path: Path) -> None:
    """The command itself, in a process that may open 384 files (as the issue's reproduction ran out
    of them), with 300 connections from one address trickling a body byte every half second: the
    connection caps keep it under its file limit, so ``/health`` from another address answers at once
    the whole time, the tricklers it took get a 408 at the body deadline, and the log stays small
    (on the old code: no answer for as long as the trickle lasted, and 165 MB of log in 45 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "proxy.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hicache.cli", "pd-proxy", "--prefill", "http://127.0.0.1:1", "--decode",
             "http://127.0.0.1:1", "--port", str(port), "--max-in-flight", "32", "--max-connections", "1000",
             "--max-connections-per-client", "50", "--body-timeout-s", "2"],
            stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_small_fd_limit, env={**os.environ},
        )
    tricklers: list[asyncio.Task[bytes]] = []
    try:
        async def health() -> float:
            started = time.monotonic()
            reader, writer = await raw_connection(port, "127.0.0.2")
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert b'"status": "ok"' in await answer_of(reader, within_s=5)
            finally:
                writer.close()
            return time.monotonic() - started

        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                await health()
                break
            except OSError:
                assert time.monotonic() < deadline, "the proxy never came up"
                await asyncio.sleep(0.2)

        async def trickle() -> bytes:
            """A body byte every half second, until the proxy answers (and what it answered)."""
            try:
                reader, writer = await raw_connection(port)
            except OSError:
                return b"<not connected>"
            answer = asyncio.create_task(reader.read())
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
                for _ in range(20):
                    done, _ = await asyncio.wait([answer], timeout=0.5)
                    if done or writer.is_closing():
                        break
                    writer.write(b" ")
                return await asyncio.wait_for(answer, 1)
            except (ConnectionError, TimeoutError):
                return b"<closed>"
            finally:
                answer.cancel()
                writer.close()

        tricklers = [asyncio.create_task(trickle()) for _ in range(300)]
        waits = []
        for _ in range(8):
            await asyncio.sleep(0.5)
            waits.append(await health())
        answers = await asyncio.gather(*tricklers)
    finally:
        for task in tricklers:
            task.cancel()
        proc.terminate()
        proc.wait(10)
    log_text = log_path.read_text()
    assert max(waits) < 1.5, waits
    # It took 50 connections (its cap for one address) and 32 requests (--max-in-flight): those trickled
    # until the body deadline, a 408; the rest were refused at once, a 503 (or cut, writing into a closed socket).
    kinds = Counter(a[:12].decode() if a.startswith(b"HTTP/1.1") else "cut" for a in answers)
    assert kinds["HTTP/1.1 408"] == 32 and kinds["HTTP/1.1 503"] + kinds["cut"] == 268, kinds
    assert "fits 160 client connections, not --max-connections 1000" in log_text
    assert len(log_text) < 20_000, log_text[-3000:]
    assert "Too many open files" not in log_text
