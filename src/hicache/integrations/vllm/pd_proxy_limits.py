"""What keeps ``hicache pd-proxy`` answering under load and abuse: caps on connections and requests in flight.

* ``InFlight``: requests in flight, capped in total (over it: **503**) and per client (over it: **429**),
  both answered at once with ``Retry-After``, before the body is read. A client is the peer's address;
  ``X-Forwarded-For`` is believed only when the peer is one of ``trusted_proxies`` (anyone can write the
  header, so by default it is ignored).
* ``CappedSite``: an aiohttp site that caps open connections, in total and per peer address; a
  connection over the cap gets a 503 and is closed at once, so the process stays under its file
  descriptor limit and never spins on ``EMFILE`` (``fit_fd_budget`` checks the limit at start).
* ``RateLimitedLog`` and ``quiet_exception_handler``: refused connections and the event loop's own
  errors (``accept()`` failing) are logged at most a few lines per interval, with a count of the rest.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

__all__ = ["CappedSite", "InFlight", "RateLimitedLog", "client_address", "fit_fd_budget", "quiet_exception_handler"]

log = logging.getLogger("hicache.integrations.vllm.pd_proxy")

#: File descriptors kept free beside client and upstream connections (the listening socket, logs, DNS...).
FD_RESERVE = 64


class RateLimitedLog:
    """At most ``burst`` lines per ``interval_s`` for each key; what was held back is counted in the next line."""

    def __init__(self, interval_s: float = 10.0, burst: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.burst, self._clock = interval_s, burst, clock
        self._windows: dict[str, list[float]] = {}  # key -> [window start, lines in it, held back]

    def allow(self, key: str) -> tuple[bool, int]:
        """Whether a line for ``key`` may be written now, and how many were held back before it."""
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.interval_s:
            held = int(window[2]) if window is not None else 0
            self._windows[key] = [now, 1, 0]
            if len(self._windows) > 256:  # keys are few (messages, not addresses); never let them grow
                self._windows = {key: self._windows[key]}
            return True, held
        if window[1] < self.burst:
            window[1] += 1
            return True, 0
        window[2] += 1
        return False, 0

    def log(self, level: int, key: str, message: str, *args: Any) -> None:
        ok, held = self.allow(key)
        if ok:
            suffix = f" ({held} more like it not logged in the last {self.interval_s:.0f}s)" if held else ""
            log.log(level, message + suffix, *args)


ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]


def quiet_exception_handler(limiter: RateLimitedLog | None = None) -> ExceptionHandler:
    """An event loop exception handler that passes on a few of each kind of error and counts the rest.

    asyncio reports a failing ``accept()`` (``EMFILE``: out of file descriptors) through it, with a
    traceback each time; under a connection flood that was hundreds of MB of log."""
    limiter = limiter or RateLimitedLog()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        ok, held = limiter.allow(str(context.get("message", "?")))
        if ok:
            if held:
                context = {**context, "message": f"{context.get('message')} ({held} more not logged)"}
            loop.default_exception_handler(context)

    return handler


class InFlight:
    """Requests in flight, in total and per client; ``enter`` refuses (a status) or counts one in."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self.now = 0
        self.clients: dict[str, int] = {}
        self.refused = {429: 0, 503: 0}

    def enter(self, client: str) -> int | None:
        """``None``: admitted (call ``leave`` after); else the status to answer (429 or 503)."""
        held = self.clients.get(client, 0)
        if held >= self.per_client:
            self.refused[429] += 1
            return 429
        if self.now >= self.total:
            self.refused[503] += 1
            return 503
        self.now += 1
        self.clients[client] = held + 1
        return None

    def leave(self, client: str) -> None:
        self.now -= 1
        held = self.clients[client] - 1
        if held:
            self.clients[client] = held
        else:
            del self.clients[client]


def parse_networks(texts: Sequence[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``["10.0.0.5", "10.1.0.0/16"]`` -> networks; ``ValueError`` for one that is not an address or CIDR."""
    return tuple(ipaddress.ip_network(t.strip(), strict=False) for t in texts if t.strip())


def client_address(peer: str | None, forwarded_for: str | None, trusted: Sequence[Any]) -> str:
    """Who a request is from: the peer's address, or, when the peer is a trusted proxy, the nearest
    address in ``X-Forwarded-For`` that is not one (the header's left part is whatever the client wrote)."""
    peer = peer or "?"
    if not trusted or not forwarded_for or not _in(peer, trusted):
        return peer
    for hop in reversed([h.strip() for h in forwarded_for.split(",")]):
        if not hop:
            continue
        if not _in(hop, trusted):
            try:
                return str(ipaddress.ip_address(hop))
            except ValueError:
                return peer  # garbage in the header: count it against the proxy that sent it
    return peer


def _in(address: str, networks: Sequence[Any]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


#: The listening queue, and how many connections asyncio accepts at one wake-up: each holds a file
#: descriptor before the cap can refuse it, so the budget counts them too.
BACKLOG = 128


def fit_fd_budget(max_connections: int, upstream_connections: int) -> int:
    """The connection cap that fits this process's file descriptor limit (raising the soft limit
    towards the hard one first); ``ValueError`` when not even a few connections would fit."""
    need = max_connections + upstream_connections + BACKLOG + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    fits = soft - upstream_connections - BACKLOG - FD_RESERVE
    if fits < 16:
        raise ValueError(f"the file descriptor limit ({soft}) leaves no room for client connections beside "
                         f"{upstream_connections} upstream ones: raise `ulimit -n` or lower --max-in-flight")
    log.warning("the file descriptor limit (%d) fits %d client connections, not --max-connections %d: capping "
                "at %d (raise `ulimit -n` for more)", soft, fits, max_connections, fits)
    return fits


_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
_REFUSAL_BODY = b'{"error": {"message": "too many connections to this proxy", "type": "overloaded", "code": 503}}'


class _Refuse(asyncio.Protocol):
    """A connection over the cap: a 503 and closed, nothing read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_REFUSAL % (len(_REFUSAL_BODY), _REFUSAL_BODY))
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted while open (per peer too)."""

    def __init__(self, site: CappedSite, inner: Any) -> None:
        self._site, self._inner, self._peer = site, inner, None
        self._counted = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._peer = peer[0] if isinstance(peer, tuple) else str(peer)
        held = self._site.per_peer.get(self._peer, 0)
        if held >= self._site.max_per_client:
            self._site.refuse(f"from {self._peer}, {held} connections already")
            self._site.open -= 1
            self._counted = False
            _Refuse().connection_made(transport)
            return
        self._site.per_peer[self._peer] = held + 1
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._counted:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._counted else None

    def pause_writing(self) -> None:
        if self._counted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._counted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._site.open -= 1
        held = self._site.per_peer.get(self._peer, 1) - 1
        if held > 0:
            self._site.per_peer[self._peer] = held
        else:
            self._site.per_peer.pop(self._peer, None)
        self._inner.connection_lost(exc)


class CappedSite(web.BaseSite):
    """A TCP site whose open connections are capped, in total and per peer address."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int,
                 max_per_client: int, backlog: int = BACKLOG) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.open = 0
        self.per_peer: dict[str, int] = {}
        self.refused = 0
        self._log = RateLimitedLog(interval_s=10.0, burst=1)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    def refuse(self, why: str) -> None:
        self.refused += 1
        self._log.log(logging.WARNING, "refused", "refused a connection over the cap (%s)", why)

    def _protocol(self) -> asyncio.BaseProtocol:
        if self.open >= self.max_connections:
            self.refuse(f"{self.open} open, --max-connections {self.max_connections}")
            return _Refuse()
        server = self._runner.server
        assert server is not None
        self.open += 1
        return _Counted(self, server())

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port, backlog=self._backlog)
