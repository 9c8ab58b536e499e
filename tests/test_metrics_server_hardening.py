"""The metrics/admin server under pressure and from a web page (issue #50, items 3 and 7).

Item 3: the server's accept errors and handler errors never end the caller's block (in the vLLM
worker, the whole cache service), and connections are capped. The fd exhaustion is real: a child
process lowers its own RLIMIT_NOFILE and this test opens connections until its accept() fails with
EMFILE. Item 7: without an admin token, nothing a browser can send (a form or text/plain POST, an
``Origin``, a rebound ``Host``, ``Sec-Fetch-Site``) reaches the admin routes; ``hicache admin`` does.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

import hicache
from hicache import HiCache
from hicache.metrics import serve
from hicache.metrics.admin_cli import main as admin_main

from .test_admin_endpoint import HEALTHZ, raw
from .test_attach_detach import config, file_entry

# -- item 3: accept errors, handler errors, the connection cap ------------------------------------

CHILD = r"""
import logging, os, resource, sys
import anyio
from hicache import HiCache, load_config
from hicache.metrics import serve

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
MODEL = {"name": "m", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"}

async def main(stop: str) -> None:
    cfg = load_config(overrides={"model": MODEL, "page_size": 4, "tiers": {"storage": []}}, env={})
    async with HiCache.from_config(cfg) as cache, serve(cache, port=0) as server:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 6, hard))  # room for a few connections only
        print(server.port, flush=True)
        ticks = 0
        while not os.path.exists(stop):  # the caller's body: it must run until it chooses to end
            await anyio.sleep(0.02)
            ticks += 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("body ended on its own after", ticks, "ticks", flush=True)

anyio.run(main, sys.argv[1])
"""


def connect(port: int, n: int) -> list[socket.socket]:
    """``n`` idle connections (the kernel completes them whether or not the server accepts)."""
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def healthz_within(port: int, seconds: float) -> tuple[int, bytes]:
    deadline = time.monotonic() + seconds
    while True:
        try:
            answer = raw(port, HEALTHZ)
        except OSError:
            answer = (0, b"")
        if answer[0] == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts its fds in /proc/self/fd")
def test_fd_exhaustion_is_survived_and_the_callers_body_runs_on(tmp_path: Path) -> None:
    """EMFILE from accept() came out of ``serve``'s task group and cancelled the caller's body:
    the child died with the OSError and nothing answered on the port again."""
    script, stop = tmp_path / "child.py", tmp_path / "stop"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path(hicache.__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, str(script), str(stop)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        flood = connect(port, 40)  # far more than the child has fds for: its accept() fails with EMFILE
        try:
            time.sleep(2.0)  # several accept retries, backed off
            assert child.poll() is None, child.communicate(timeout=10)[1][-3000:]
        finally:
            for sock in flood:
                sock.close()
        assert healthz_within(port, 15) == (200, b"ok\n")  # the fds came back: it serves again
        stop.touch()
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, err[-3000:]
    assert "body ended on its own" in out, (out, err[-3000:])
    # The errors were real, logged, and logged once (not once per retry).
    assert err.count("accept failed (EMFILE") == 1, err[-3000:]


async def test_a_flood_over_the_cap_is_closed_at_once_and_the_server_answers_after_it() -> None:
    """Every connection was held (no cap): 200 idle connections held 200 fds of the cache's process."""
    ticks = 0

    async def body_ticks() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with HiCache.from_config(config([])) as cache, serve(cache, port=0) as server, \
            anyio.create_task_group() as tg:
        tg.start_soon(body_ticks)
        flood = await anyio.to_thread.run_sync(connect, server.port, 200)
        try:
            before = ticks
            for _ in range(50):  # until the server has taken all 200 from its queue (bounded: 5 s)
                await anyio.sleep(0.1)
                held = await anyio.to_thread.run_sync(count_open, flood)
                if held <= 64:
                    break
            assert held == 64, f"{held} of 200 connections held; the cap is 64"
            await anyio.sleep(0.2)
            assert ticks > before, "the caller's body stopped running"
        finally:
            for sock in flood:
                sock.close()
        assert await anyio.to_thread.run_sync(healthz_within, server.port, 5.0) == (200, b"ok\n")
        tg.cancel_scope.cancel()
    with pytest.raises(Exception, match="max_connections"):
        async with HiCache.from_config(config([])) as cache, serve(cache, port=0, max_connections=0):
            pass


def count_open(socks: list[socket.socket]) -> int:
    """How many the server still holds open (not closed with a FIN or a reset)."""
    held = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            held += sock.recv(1) != b""
        except BlockingIOError:
            held += 1
        except ConnectionResetError:
            pass
    return held


class _UnnamableMeta(type):
    @property
    def __name__(cls) -> str:  # type: ignore[override]
        raise RuntimeError("fault injected: this exception's type cannot even be named")


class _UnnamableError(Exception, metaclass=_UnnamableMeta):
    """Fault injection: an exception that breaks the handler's own error path (it logs the type's name)."""


class FailingCollector(Collector):
    """Fault injection: a collector (public interface: ``serve(registry=...)``) whose scrape raises."""

    def collect(self) -> Any:
        raise _UnnamableError()


async def test_a_handler_that_raises_costs_its_connection_only() -> None:
    """An error that escaped the handler ended ``serve``'s task group and the caller's block with it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FailingCollector())
    async with HiCache.from_config(config([])) as cache, serve(cache, port=0, registry=registry) as server:
        status, _ = await anyio.to_thread.run_sync(raw, server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 0  # no answer: the connection was closed
        await anyio.sleep(0.2)  # the block still runs (a cancel would land on this await)
        assert await anyio.to_thread.run_sync(raw, server.port, HEALTHZ) == (200, b"ok\n")


# -- item 7: what a web page can send never reaches the admin routes ------------------------------


def request(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"",
            version: str = "1.1") -> tuple[int, bytes]:
    head = f"{method} {path} HTTP/{version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return raw(port, (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)


def refused_requests(port: int, body: bytes) -> list[tuple[int, str, str, dict[str, str]]]:
    """``(status, method, path, headers)`` of what a web page (or a rebound name) can send."""
    local = {"Host": f"127.0.0.1:{port}"}
    jsonish = {**local, "Content-Type": "application/json"}
    attach = "/admin/storage/attach"
    return [
        (415, "POST", attach, {**local, "Content-Type": "text/plain"}),  # a fetch without preflight
        (415, "POST", attach, {**local, "Content-Type": "application/x-www-form-urlencoded"}),  # a form
        (415, "POST", attach, {**local, "Content-Type": "multipart/form-data; boundary=x"}),
        (415, "POST", attach, local),  # no Content-Type
        (403, "POST", attach, {**jsonish, "Origin": "http://evil.example"}),
        (403, "POST", attach, {**jsonish, "Origin": "null"}),
        (403, "POST", attach, {**jsonish, "Host": "evil.example"}),  # DNS rebinding
        (403, "POST", attach, {**jsonish, "Host": f"evil.example:{port}"}),
        (403, "POST", attach, {**jsonish, "Host": "127.0.0.1.evil.example"}),
        (403, "POST", attach, {**jsonish, "Sec-Fetch-Site": "cross-site"}),
        (403, "GET", "/admin/storage", {"Host": f"evil.example:{port}"}),  # a rebound page reading the chain
        (403, "GET", "/admin/storage", {**local, "Origin": "http://evil.example"}),
    ]


async def test_tokenless_admin_takes_nothing_a_web_page_can_send(tmp_path: Path) -> None:
    """Any Content-Type, Host and Origin attached a tier: a page the operator opened could send
    every later page elsewhere."""
    entry = file_entry(tmp_path)
    body = json.dumps({"entry": entry}).encode()
    async with HiCache.from_config(config([])) as cache, serve(cache, port=0, admin=True) as server:
        port = server.port
        for status, method, path, headers in refused_requests(port, body):
            got, answer = await anyio.to_thread.run_sync(
                lambda: request(port, method, path, headers, body if method == "POST" else b""))
            assert got == status, (headers, answer)
            assert "error" in json.loads(answer)
            assert list(cache.stats().storage) == [] and not (tmp_path / "disk").exists(), headers
        # HTTP/1.0 needs no Host: without one, nothing says the request came from this host.
        got, _ = await anyio.to_thread.run_sync(
            lambda: request(port, "POST", "/admin/storage/attach", {"Content-Type": "application/json"}, body, "1.0"))
        assert got == 403 and list(cache.stats().storage) == []
        # /metrics and /healthz stay open to any Host (Prometheus scrapes by whatever name it knows).
        assert (await anyio.to_thread.run_sync(request, port, "GET", "/healthz", {"Host": "evil.example"}))[0] == 200
        # Every loopback spelling of Host, and a person's own navigation (Sec-Fetch-Site: none), are served.
        for host in (f"127.0.0.1:{port}", "127.0.0.1", "localhost", f"LOCALHOST:{port}", f"[::1]:{port}", "[::1]",
                     "127.0.0.2"):
            got, answer = await anyio.to_thread.run_sync(request, port, "GET", "/admin/storage", {"Host": host})
            assert (got, json.loads(answer)) == (200, {"storage": []}), host
        got, _ = await anyio.to_thread.run_sync(
            request, port, "GET", "/admin/storage", {"Host": "localhost", "Sec-Fetch-Site": "none"})
        assert got == 200
        # `hicache admin` (urllib: a loopback Host, JSON, no Origin) still attaches, lists and detaches.
        entry_file = tmp_path / "disk.yaml"
        entry_file.write_text(f"kind: file\nname: disk\npath: {tmp_path / 'disk'}\nfsync: never\n")
        for argv in (["--url", server.url, "attach", str(entry_file)],
                     ["--url", f"http://localhost:{port}", "storage"],
                     ["--url", server.url, "detach", "disk"]):
            code, out = await anyio.to_thread.run_sync(run_admin, argv)
            assert code == 0, out
            if argv[-1] == "storage":
                assert json.loads(out) == {"storage": [{"name": "disk", "kind": "file", "position": 0}]}
        assert list(cache.stats().storage) == []


def run_admin(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("HICACHE_ADMIN_TOKEN", raising=False)
        mp.setattr("sys.stdout", out)
        code = admin_main(argv)
    return code, out.getvalue()


async def test_with_a_token_admin_posts_still_need_json(tmp_path: Path) -> None:
    """With a token, the token is the guard (an Origin is no reason to refuse its holder), but a
    form or text/plain POST was taken as JSON."""
    token = "t0k3n-for-the-hardening-test"
    body = json.dumps({"entry": file_entry(tmp_path)}).encode()
    async with HiCache.from_config(config([])) as cache, \
            serve(cache, port=0, admin=True, admin_token=token) as server:
        port = server.port
        auth = {"Host": "127.0.0.1", "Authorization": f"Bearer {token}"}
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            got, _ = await anyio.to_thread.run_sync(
                lambda: request(port, "POST", "/admin/storage/attach", {**auth, "Content-Type": ctype}, body))
            assert got == 415 and list(cache.stats().storage) == []
        got, _ = await anyio.to_thread.run_sync(lambda: request(
            port, "POST", "/admin/storage/attach", {"Host": "evil.example", "Content-Type": "application/json"}, body))
        assert got == 401
        got, answer = await anyio.to_thread.run_sync(lambda: request(
            port, "POST", "/admin/storage/attach",
            {**auth, "Host": "evil.example", "Origin": "http://evil.example",
             "Content-Type": "application/json; charset=utf-8"}, body))
        assert got == 200 and json.loads(answer)["chain"] == ["disk"]
