"""Fault-injecting fakes, named as such: io backends that stall or fail, storage backends that fail,
stall, crawl, fail every other write or refuse pages, and slowed wrappers around the real ones (pressure suite). Storage fakes are configured by class path, e.g.
``{"kind": "tests.fakes:SlowStorageBackend", "delay_s": 0.1}``."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from hicache.io.kernel import KernelIOBackend
from hicache.tiers.storage.base import BackendSettings, PageIO, StorageBackend
from hicache.tiers.storage.memory import MemoryBackend
from hicache.tiers.storage.registry import resolve_backend


class StallingIOBackend(KernelIOBackend):
    """The real kernel backend, but per-layer copies of ``stall_layer`` and later wait for ``release()``.

    Only layer-wise copies (``layer`` given) stall, so stores and backups run normally.
    """

    def __init__(self, stall_layer: int) -> None:
        self.stall_layer = stall_layer
        self._gate = threading.Event()
        self.stalled = threading.Event()  # set once a copy is waiting at the gate
        self.layers_copied: list[int] = []

    def release(self) -> None:
        self._gate.set()

    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: Any, *, layer: int | None = None) -> None:
        if layer is not None and layer >= self.stall_layer:
            self.stalled.set()
            if not self._gate.wait(timeout=30):
                raise TimeoutError("StallingIOBackend was never released")
        super().copy(src, dst, plan, layer=layer)
        if layer is not None:
            self.layers_copied.append(layer)


class FailingIOBackend(KernelIOBackend):
    """The real kernel backend until ``armed``; then every copy raises ``OSError``."""

    def __init__(self) -> None:
        self.armed = False

    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: Any, *, layer: int | None = None) -> None:
        if self.armed:
            raise OSError("injected copy failure")
        super().copy(src, dst, plan, layer=layer)


# -- storage backends that misbehave on purpose ------------------------------------------------


class FailingStorageBackend(StorageBackend):
    """Fault fake: every operation raises, like a backend whose server is gone."""

    kind = "failing"

    async def _exists(self, keys: Sequence[bytes]) -> int:
        raise ConnectionError("storage server unreachable")

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        raise ConnectionError("storage server unreachable")

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        raise ConnectionError("storage server unreachable")


class StallingStorageBackend(MemoryBackend):
    """Fault fake: the in-memory backend, but every call hangs until cancelled (a dead peer)."""

    kind = "stalling"

    async def _exists(self, keys: Sequence[bytes]) -> int:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


class SlowStorageBackend(MemoryBackend):
    """Fault fake: the in-memory backend, but each page read takes ``delay_s`` (a slow disk or link)."""

    kind = "slow"

    class Settings(MemoryBackend.Settings):
        delay_s: float = 0.05

    settings: Settings

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        for i in range(len(keys)):
            await anyio.sleep(self.settings.delay_s)
            if await super()._get(keys[i : i + 1], into[i : i + 1]) == 0:
                return i
        return len(keys)


class FlakyStorageBackend(MemoryBackend):
    """Fault fake: the in-memory backend, but every other ``set`` call fails after storing nothing."""

    kind = "flaky"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.set_calls = 0

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        self.set_calls += 1
        if self.set_calls % 2 == 0:
            raise OSError("disk full")
        return await super()._set(keys, pages)


# -- slowed real components, for the pressure suite -------------------------------------------


class DelayingStorageBackend(StorageBackend):
    """Fault fake: a real backend (``inner``: any tier entry, e.g. ``{"kind": "file", ...}``) behind a
    link that adds ``delay_s`` per call and ``per_page_s`` per page: a lower tier slower than the
    traffic. Every byte still goes to and comes from the real backend."""

    kind = "delaying"
    #: As the real backends it wraps in the tests (file, redis, mooncake): pages of any size
    #: (codec chains, a layer-split tier's two parts).
    variable_size_pages = True

    class Settings(BackendSettings):
        inner: dict[str, Any]
        delay_s: float = 0.01
        per_page_s: float = 0.0

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        inner = dict(self.settings.inner)
        self.inner = resolve_backend(inner.pop("kind"))(**inner)

    async def _lag(self, pages: int) -> None:
        await anyio.sleep(self.settings.delay_s + self.settings.per_page_s * pages)

    async def _open(self) -> None:
        await self.inner.open()

    async def _aclose(self) -> None:
        await self.inner.aclose()

    async def _exists(self, keys: Sequence[bytes]) -> int:
        await self._lag(0)
        return await self.inner._exists(keys)

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        await self._lag(len(keys))
        return await self.inner._get(keys, into)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        await self._lag(len(keys))
        return await self.inner._get_sized(keys, into, sizes)

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        await self._lag(len(keys))
        return await self.inner._set(keys, pages)

    async def _delete(self, keys: Sequence[bytes]) -> None:
        await self.inner._delete(keys)

    async def _clear(self) -> None:
        await self.inner._clear()


class FailingFirstCallsStorageBackend(DelayingStorageBackend):
    """Fault fake: a real backend (``inner``) whose first ``write_failures`` ``set`` calls and first
    ``read_failures`` ``get`` calls fail after moving nothing (a store that revokes puts, or whose
    transfers time out, for a moment), then work as the backend does."""

    kind = "failing-first-calls"

    class Settings(DelayingStorageBackend.Settings):
        delay_s: float = 0.0
        write_failures: int = 0
        read_failures: int = 0

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.set_calls = 0
        self.get_calls = 0

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        self.set_calls += 1
        if self.set_calls <= self.settings.write_failures:
            raise OSError("put revoked (injected)")
        return await super()._set(keys, pages)

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        self.get_calls += 1
        if self.get_calls <= self.settings.read_failures:
            raise TimeoutError("transfer timed out (injected)")
        return await super()._get(keys, into)


class PageRefusingStorageBackend(DelayingStorageBackend):
    """Fault fake: a real backend (``inner``) that stores the first ``accept_pages`` pages of KV it is
    given and then refuses every other (a store out of room for them), while small objects (a
    header and no payload: a hand-off's gave-up marker) are always stored."""

    kind = "page-refusing"

    class Settings(DelayingStorageBackend.Settings):
        delay_s: float = 0.0
        accept_pages: int = 0

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.accepted = 0

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        if any(io.payload_bytes for io in pages):
            room = self.settings.accept_pages - self.accepted
            if room <= 0:
                raise OSError("no room for pages (injected)")
            done = await super()._set(keys[:room], pages[:room])
            self.accepted += done
            return done
        return await super()._set(keys, pages)


class PageDelayingStorageBackend(DelayingStorageBackend):
    """Fault fake: a real backend (``inner``) whose writes of KV pages take ``per_page_s`` a page (a
    store slower than the hand-off), while small objects (a header and no payload: a hand-off's
    markers and pulses) are written at once."""

    kind = "page-delaying"

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        if any(io.payload_bytes for io in pages):
            await self._lag(len(keys))
        return await self.inner._set(keys, pages)


class ExistsOutageStorageBackend(DelayingStorageBackend):
    """Fault fake: a real backend (``inner``) unreachable for a moment: once an ``exists`` asks for
    a key in ``watched`` (storage keys, set by the test), that call and the next ``outage_reads - 1``
    that ask for one fail; ``failed`` lists the keys those calls asked for."""

    kind = "exists-outage"

    class Settings(DelayingStorageBackend.Settings):
        delay_s: float = 0.0
        outage_reads: int = 1

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.watched: set[bytes] = set()
        self.failed: list[bytes] = []
        self.failed_reads = 0

    async def _exists(self, keys: Sequence[bytes]) -> int:
        if self.failed_reads < self.settings.outage_reads and self.watched.intersection(keys):
            self.failed_reads += 1
            self.failed.extend(keys)
            raise OSError("store unreachable (injected)")
        return await super()._exists(keys)


class SlowIOBackend(KernelIOBackend):
    """Fault fake: the real kernel io backend, but every copy also sleeps ``delay_s`` in its worker
    thread (a slow link between device and host), so backups, spills and load-backs stay in flight."""

    def __init__(self, delay_s: float = 0.005) -> None:
        self.delay_s = delay_s

    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: Any, *, layer: int | None = None) -> None:
        time.sleep(self.delay_s)
        super().copy(src, dst, plan, layer=layer)


#: What a dripping ``nixl-peer`` fake announces: a frame of 8 MiB, then sent one byte at a time.
DRIP_FRAME = (8 * 1024**2).to_bytes(4, "little") + b"K"


def _drip(sock: Any, stop: threading.Event, every_s: float, for_s: float) -> None:
    """Announce a large frame on ``sock`` and send its body one byte every ``every_s``, for ``for_s``
    at most (so a client that waits byte by byte is held that long, then the connection closes)."""
    end = time.monotonic() + for_s
    try:
        sock.sendall(DRIP_FRAME)
        while not stop.wait(every_s) and time.monotonic() < end:
            sock.sendall(b"\0")
    except OSError:
        pass
    finally:
        sock.close()


class FakeProducer:
    """A fault-injecting stand-in for a ``nixl-peer`` producer's metadata server, on loopback.

    ``mode="silent"`` accepts connections and never answers; ``mode="garbage"`` answers every frame
    with bytes that are no valid answer; ``mode="drip"`` answers the first frame with a large frame
    sent one byte every ``drip_every_s`` (for ``drip_for_s`` at most); ``mode="impostor"`` plays the
    authentication exchange without the secret (a challenge, then takes any proof and answers HELLO
    with a MAC it cannot make). ``stop()`` closes everything.
    """

    def __init__(self, mode: str, *, drip_every_s: float = 0.1, drip_for_s: float = 8.0) -> None:
        import socket

        self.mode = mode
        self.drip_every_s, self.drip_for_s = drip_every_s, drip_for_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[Any] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._socks.append(sock)
            if self.mode == "garbage":
                try:
                    sock.recv(65536)
                    sock.sendall(b"\xff\xff\xff\x7fHgarbage")  # a frame length over the limit
                except OSError:
                    pass
            elif self.mode == "drip":
                threading.Thread(target=self._drip_after_request, args=(sock,), daemon=True).start()
            elif self.mode == "impostor":
                threading.Thread(target=self._impostor, args=(sock,), daemon=True).start()

    def _impostor(self, sock: Any) -> None:
        import os

        from hicache.tiers.storage.nixl import peer_wire as wire

        deadline = time.monotonic() + 5
        try:
            wire.recv_frame(sock, deadline)  # AUTH
            wire.send_frame(sock, wire.OK, wire.MAGIC + os.urandom(32), deadline)
            wire.recv_frame(sock, deadline)  # the consumer's proof, not checked
            wire.send_frame(sock, wire.OK, os.urandom(64), deadline)  # "HELLO", with no valid MAC
            self._stop.wait(5)
        except (OSError, ConnectionError):
            pass

    def _drip_after_request(self, sock: Any) -> None:
        try:
            sock.recv(65536)
        except OSError:
            return
        _drip(sock, self._stop, self.drip_every_s, self.drip_for_s)

    def stop(self) -> None:
        import socket

        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in self._socks:
            sock.close()
        self._thread.join(5)


class DrippingProxy:
    """A fault-injecting relay in front of a real ``nixl-peer`` producer, on loopback.

    It passes every frame both ways unchanged (the handshake and HELLO included, so the consumer is
    authenticated and connected for real) until the consumer sends a request whose op is in
    ``drip_on``; the producer's answer to it is swallowed and replaced by a large frame sent one byte
    every ``drip_every_s`` (for ``drip_for_s`` at most): a producer that goes slow mid-exchange.
    """

    def __init__(self, target: tuple[str, int], *, drip_on: bytes = b"L", drip_every_s: float = 0.1,
                 drip_for_s: float = 8.0) -> None:
        import socket

        self.target, self.drip_on = target, drip_on
        self.drip_every_s, self.drip_for_s = drip_every_s, drip_for_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[Any] = []
        #: Answers replaced by a drip so far.
        self.dripped = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import socket

        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                return
            self._socks += [client, server]
            pending = threading.Event()  # set: the next answer is to be dripped
            threading.Thread(target=self._relay, args=(client, server, pending, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client, pending, False), daemon=True).start()

    def _relay(self, src: Any, dst: Any, pending: threading.Event, requests: bool) -> None:
        try:
            while not self._stop.is_set():
                header = _read_exactly(src, 5)
                body = _read_exactly(src, int.from_bytes(header[:4], "little") - 1)
                if requests:
                    if header[4:5] in self.drip_on:
                        pending.set()
                    dst.sendall(header + body)
                elif pending.is_set():
                    self.dripped += 1
                    _drip(dst, self._stop, self.drip_every_s, self.drip_for_s)
                    return
                else:
                    dst.sendall(header + body)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass

    def stop(self) -> None:
        import socket

        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._thread.join(5)


def _read_exactly(sock: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data
