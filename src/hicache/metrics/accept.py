"""``serve_connections``: an accept loop that neither fd pressure nor a connection flood can end.

anyio's ``listener.serve`` lets the first ``accept()`` error out of its task group: an ``EMFILE``
(the process out of file descriptors, or a flood of connections on ``metrics_port``) cancelled the
block around ``serve``, which in the vLLM worker is the whole cache service. Here:

* an accept error is logged (once per ``logging.repeat_interval_s`` and errno, with how many were
  not), backed off (0.1 s, doubling to 1 s; the pending connection stays in the kernel's queue, so
  retrying at once would spin) and survived; only the listener's close or a cancel ends the loop;
* at most ``max_connections`` are served at once; one over the cap is closed at once, unread. That
  is the cheapest answer (no parse, no write, no fd held): a ``503`` would cost a write to a client
  that may not read it, and, with its request unread, the close would often reset it away anyway;
  and it keeps the kernel's queue empty, so the server answers as soon as a flood ends instead of
  working through thousands of queued connections first;
* a handler that raises is logged and its connection closed: nothing one connection does ends the
  loop, or the caller's block.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import SocketListener, SocketStream, TaskGroup
from anyio.streams.stapled import MultiListener

from ..logs import RateLimited

__all__ = ["BACKOFF_MAX_S", "BACKOFF_MIN_S", "serve_connections"]

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 1.0

log = logging.getLogger("hicache.metrics.server")  # the server's logger: one level covers both


async def serve_connections(
    listener: SocketListener | MultiListener[SocketStream],
    handler: Callable[[SocketStream], Awaitable[None]],
    task_group: TaskGroup,
    max_connections: int,
) -> None:
    """Accept connections (on each of ``listener``'s sockets: ``localhost`` may be two) and run
    ``handler`` on each in ``task_group``, ``max_connections`` at once in all, until the listener
    closes or the task is cancelled; never raises anything an accept or a handler raised."""
    state = _Connections(handler, max_connections)
    async with anyio.create_task_group() as loops:
        for one in getattr(listener, "listeners", [listener]):
            loops.start_soon(state.accept_loop, one, task_group)


class _Connections:
    """What the accept loops of one server share: the handler, the cap and the count."""

    def __init__(self, handler: Callable[[SocketStream], Awaitable[None]], max_connections: int) -> None:
        self.handler = handler
        self.max_connections = max_connections
        self.open_now = 0
        self.limited = RateLimited(log)

    async def accept_loop(self, listener: SocketListener, task_group: TaskGroup) -> None:
        backoff = 0.0
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return  # the listener was closed: serve's block ended
            except Exception as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED, ...: wait, try again
                backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, backoff * 2))
                code = (errno.errorcode.get(exc.errno or 0, str(exc.errno)) if isinstance(exc, OSError)
                        else type(exc).__name__)
                self.limited.warning(f"accept:{code}", "metrics server: accept failed (%s: %s); retrying in %.1f s, "
                                     "connections open: %d", code, exc, backoff, self.open_now)
                await anyio.sleep(backoff)
                continue
            backoff = 0.0
            if self.open_now >= self.max_connections:
                self.limited.warning("cap", "metrics server: %d connections open (max_connections); closing new "
                                     "ones at once until one ends", self.open_now)
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                continue
            self.open_now += 1
            task_group.start_soon(self._one, stream)

    async def _one(self, stream: SocketStream) -> None:
        try:
            await self.handler(stream)
        except Exception as exc:  # a bug costs this connection, never the loop (handle answers 500s itself)
            self.limited.warning(f"handler:{type(exc).__name__}",
                                 "metrics server: a connection's handler failed (%s); connection closed",
                                 type(exc).__name__)
            log.debug("metrics server: the handler's failure", exc_info=exc)
        finally:
            self.open_now -= 1
            with anyio.CancelScope(shield=True):
                await stream.aclose()
