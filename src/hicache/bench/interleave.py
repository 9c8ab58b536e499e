"""``--interleave``: the configurations in one process, taking turns request by request.

Run one after another, two configurations meet different minutes of a shared machine, and on
these two-core VMs the same run drifts by 30-40% from one minute to the next: as much as the gaps
the oracle targets are about. Here every configuration (its own engine, cache and copy of the
trace; one model, loaded once) serves request ``k`` of the trace within seconds of the others:
the order alternates each turn (``A B C``, ``C B A``, ...), so none is favoured by going first.

A turn is one request, from arrival to last token, then the configuration's background work
(backups, storage writes) to its end (``HiCache.wait_idle``), so no configuration's work runs
during another's request. In a stream of its own, that work would run in the decode steps and
the gap before the next request (it yields to prefills); waiting for it keeps it out of every
other configuration's figures, and its length is reported per configuration (``drain``), so
nothing is hidden: a long drain says the work would have reached into the next request.

Sequential runs only (one request in flight), and not ``warm-restart`` (that needs a fresh
process by definition).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio

from ..engine import Engine, Request, RequestResult

__all__ = ["Lockstep", "Served", "TurnTakingEngine", "serve_interleaved"]


class Lockstep:
    """Grants turns to ``names`` in order, reversed after every round of turns."""

    def __init__(self, names: list[str]) -> None:
        self._order = list(names)
        self._position = 0
        self._done: set[str] = set()
        self._changed = anyio.Event()

    @property
    def current(self) -> str:
        return self._order[self._position]

    async def acquire(self, name: str) -> None:
        while self.current != name:
            await self._changed.wait()

    def release(self, name: str) -> None:
        assert self.current == name, f"{name} released a turn it did not hold"
        self._advance()

    def finished(self, name: str) -> None:
        """``name`` sends no more requests: its turns are skipped from now on."""
        self._done.add(name)
        if len(self._done) < len(self._order) and self.current in self._done:
            self._advance()
        else:
            self._wake()

    def _advance(self) -> None:
        for _ in range(2 * len(self._order)):
            self._position += 1
            if self._position == len(self._order):
                self._order.reverse()
                self._position = 0
            if self.current not in self._done or len(self._done) == len(self._order):
                break
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class TurnTakingEngine:
    """An ``Engine`` whose ``generate`` waits for its turn and, after the request, for ``drain``."""

    def __init__(self, engine: Engine, name: str, lockstep: Lockstep,
                 drain: Callable[[], Awaitable[None]] | None) -> None:
        self.engine = engine
        self.name = name
        self.lockstep = lockstep
        self.drain = drain
        self.drain_s: list[float] = []  # per request: request end -> background work done
        self.busy_s = 0.0  # time holding turns: this configuration's own share of the run
        self.turn_started_s: list[float] = []  # perf_counter at each turn's start (one clock for all)

    async def generate(self, request: Request) -> RequestResult:
        await self.lockstep.acquire(self.name)
        granted = time.perf_counter()
        self.turn_started_s.append(granted)
        try:
            result = await self.engine.generate(request)
            if self.drain is not None:
                started = time.perf_counter()
                await self.drain()
                self.drain_s.append(time.perf_counter() - started)
            return result
        finally:
            self.busy_s += time.perf_counter() - granted
            self.lockstep.release(self.name)


@dataclass(frozen=True)
class Served:
    """One configuration's part of an interleaved run."""

    records: list[Any]
    busy_s: float  # its turns' time, summed: its wall time as if it had run alone
    drain_s: list[float]  # per request: from its last token until its background work was done
    turn_started_s: list[float]  # when each of its turns began (perf_counter, the same clock for all)


async def serve_interleaved(
    names: list[str],
    open_engine: Callable[[str, AsyncExitStack], Awaitable[tuple[Engine, Callable[[], Awaitable[None]] | None]]],
    drive_one: Callable[[str, Any], Awaitable[list[Any]]],
) -> dict[str, Served]:
    """Every configuration's engine opened, then each driven through the trace, taking turns.

    ``open_engine(name, stack)`` enters what configuration ``name`` needs into ``stack`` and
    returns its engine and its drain (or ``None``); ``drive_one(name, engine)`` runs its trace.
    """
    lockstep = Lockstep(names)
    out: dict[str, Served] = {}
    async with AsyncExitStack() as stack:
        engines = {}
        for name in names:
            engine, drain = await open_engine(name, stack)
            engines[name] = TurnTakingEngine(engine, name, lockstep, drain)

        async def run(name: str) -> None:
            try:
                records = await drive_one(name, engines[name])
            finally:
                lockstep.finished(name)
            e = engines[name]
            out[name] = Served(records, e.busy_s, e.drain_s, e.turn_started_s)

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(run, name)
    return out
