"""The admin endpoint as a hostile client on loopback sees it (no token: docs/operating.md allows one there).

Secrets of the server (its environment, secret fields) never come back in an answer; a request
never makes the server import a module; requests are parsed by h11 with its limits, whatever way the
bytes arrive; a body that breaks the JSON parser is a 400, never a 500 with an ERROR in the log.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from hicache import HiCache
from hicache.errors import ConfigError
from hicache.metrics import serve

from .test_attach_detach import config, file_entry

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
SECRET = f"s3cr3t-{uuid.uuid4().hex}"  # what the server's environment holds, and nobody may read back


def raw(port: int, data: bytes, *, chunk: int | None = None) -> tuple[int, bytes]:
    """Send ``data`` (in one write, or in writes of ``chunk`` bytes) and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            if chunk is None:
                sock.sendall(data)
            else:
                for start in range(0, len(data), chunk):
                    sock.sendall(data[start : start + chunk])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking it all
        out = b""
        while True:
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            out += got
    status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/1.1 ") else 0
    return status, out.partition(b"\r\n\r\n")[2]


def post(port: int, path: str, body: bytes | dict[str, Any]) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return raw(port, head + data)


@pytest.fixture
def secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HICACHE_TENANT_KEY", "HICACHE_REDIS_PASSWORD", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, SECRET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA" + SECRET[:12])


# -- point 2: no environment, no secret in an answer ------------------------------------------


async def test_an_admin_entry_is_expanded_from_no_environment(
    tmp_path: Path, secrets_in_env: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``<a regular file>/$HICACHE_TENANT_KEY`` used to come back as ``cannot use '<file>/<the key>'``; a
    bare ``$HICACHE_TENANT_KEY`` attached and made a folder named after the key in the server's cwd."""
    regular = tmp_path / "a-file"
    regular.write_text("x")
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.DEBUG, logger="hicache")
    async with HiCache.from_config(config([])) as cache, serve(cache, port=0, admin=True) as server:
        for path in (f"{regular}/$HICACHE_TENANT_KEY", f"{regular}/$HICACHE_REDIS_PASSWORD", "$HICACHE_TENANT_KEY",
                     "pages-$HICACHE_TENANT_KEY", "~/$HICACHE_TENANT_KEY"):
            entry = {"kind": "file", "name": "leak", "path": path, "fsync": "never"}
            status, body = await anyio.to_thread.run_sync(post, server.port, "/admin/storage/attach", {"entry": entry})
            assert status == 400, (path, body)
            assert SECRET not in body.decode(), path
            assert "no environment" in json.loads(body)["error"], body
        # An s3 tier sent there takes no credentials from the server's AWS_* variables either (they
        # would sign requests to whatever endpoint the request names, a session token in plain sight).
        s3 = {"kind": "s3", "name": "leak", "endpoint_url": "http://127.0.0.1:9", "bucket": "any-bucket"}
        status, body = await anyio.to_thread.run_sync(post, server.port, "/admin/storage/attach", {"entry": s3})
        assert status == 400 and "credentials" in json.loads(body)["error"] and SECRET not in body.decode()
        assert list(cache.stats().storage) == []
    assert not any(SECRET in p.name for p in tmp_path.rglob("*")), "a folder named after the secret"
    assert SECRET not in caplog.text


async def test_no_attach_error_quotes_an_expanded_value(tmp_path: Path, secrets_in_env: None) -> None:
    """The process's own entries still expand ``$VAR`` (from code, or a config), but an error shows the
    path as written, never what a variable held; a secret field is never quoted."""
    regular = tmp_path / "a-file"
    regular.write_text("x")
    async with HiCache.from_config(config([])) as cache:
        for path in (f"{regular}/$HICACHE_TENANT_KEY", f"{regular}/$HICACHE_TENANT_KEY/pages"):
            with pytest.raises(ConfigError) as info:
                await cache.attach_storage({"kind": "file", "name": "x", "path": path, "fsync": "never"})
            assert SECRET not in str(info.value) and "$HICACHE_TENANT_KEY" in str(info.value)
        (tmp_path / SECRET).write_text("a file named like the secret")
        with pytest.raises(ConfigError) as info:
            await cache.attach_storage({"kind": "file", "path": f"{tmp_path}/$HICACHE_TENANT_KEY"})
        assert SECRET not in str(info.value) and "is a file" in str(info.value)
        with pytest.raises(ConfigError) as info:
            await cache.attach_storage({"kind": "redis", "url": "redis://127.0.0.1:1/0", "password": 3})
        assert "not shown" in str(info.value)
        # Expansion itself still works for the process's own entries.
        (tmp_path / "pages").mkdir()
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setenv("HICACHE_TEST_PAGES", str(tmp_path / "pages"))
        try:
            change = await cache.attach_storage({"kind": "file", "name": "mine", "path": "$HICACHE_TEST_PAGES/x"})
        finally:
            monkeypatch.undo()
        assert list(change.chain) == ["mine"] and (tmp_path / "pages" / "x").is_dir()


# -- point 3: a request never imports a module ----------------------------------------------------


async def test_an_admin_attach_never_imports_a_class_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = f"hostile_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nclass Thing: pass\n"
    (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    async with HiCache.from_config(config([])) as cache, serve(cache, port=0, admin=True) as server:
        for kind in (f"{module}:Thing", f"{module}.Thing", "os:system", "hicache.tiers.storage.memory:MemoryBackend"):
            status, body = await anyio.to_thread.run_sync(
                post, server.port, "/admin/storage/attach", {"entry": {"kind": kind}})
            assert status == 400, (kind, body)
            message = json.loads(body)["error"]
            assert "class path" in message and "memory" in message, message  # says what it does accept
        assert not marker.exists() and module not in sys.modules
        # Built-in kinds still attach through the endpoint.
        status, body = await anyio.to_thread.run_sync(
            post, server.port, "/admin/storage/attach", {"entry": file_entry(tmp_path)})
        assert status == 200 and json.loads(body)["chain"] == ["disk"]
    # The process's own configuration may still name a class path.
    async with HiCache.from_config(config([])) as cache:
        with pytest.raises(ConfigError, match="not a hicache StorageBackend"):
            await cache.attach_storage({"kind": f"{module}:Thing"})
    assert marker.exists()  # imported: the process asked for it
    sys.modules.pop(module, None)


# -- point 5: h11 with its limits --------------------------------------------------------------------


async def test_a_large_head_is_refused_however_it_arrives(tmp_path: Path) -> None:
    """16 KiB of request line and headers: a 48 KiB head in one write was served (200)."""
    async with HiCache.from_config(config([])) as cache, serve(cache, port=0, admin=True) as server:
        small = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 8 * 1024 + b"\r\n\r\n"
        assert await anyio.to_thread.run_sync(raw, server.port, small) == (200, b"ok\n")
        big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 48 * 1024 + b"\r\n\r\n"
        for chunk in (None, 4096, 1):
            if chunk == 1:
                big = big[: 20 * 1024] + b"\r\n\r\n"  # a byte at a time: still past the limit
            status, _ = await anyio.to_thread.run_sync(lambda big=big, chunk=chunk: raw(server.port, big, chunk=chunk))
            assert status == 431, chunk
        many = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(3000)) + b"\r\n"
        assert (await anyio.to_thread.run_sync(raw, server.port, many))[0] == 431
        # Malformed requests are 400s, and the server keeps serving.
        for bad in (b"GET /healthz\r\n\r\n", b"GET /healthz HTTP/1.1\r\nNo colon here\r\n\r\n",
                    b"POST /admin/storage/attach HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
            assert (await anyio.to_thread.run_sync(raw, server.port, bad))[0] == 400, bad
        big_body = b"{" + b" " * (65 * 1024) + b"}"
        assert (await anyio.to_thread.run_sync(post, server.port, "/admin/storage/attach", big_body))[0] == 413
        assert await anyio.to_thread.run_sync(raw, server.port, HEALTHZ) == (200, b"ok\n")


async def test_a_deeply_nested_body_is_a_400_not_a_500(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hicache")
    async with HiCache.from_config(config([])) as cache, serve(cache, port=0, admin=True) as server:
        for body in (b"[" * 30_000 + b"]" * 30_000, b'{"entry": ' * 5_000 + b"1" + b"}" * 5_000,
                     b'{"entry": ' * 400 + b"1" + b"}" * 400):
            status, answer = await anyio.to_thread.run_sync(post, server.port, "/admin/storage/attach", body)
            assert status == 400, answer[:200]
            assert "JSON" in json.loads(answer)["error"]
        assert await anyio.to_thread.run_sync(raw, server.port, HEALTHZ) == (200, b"ok\n")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
