"""Publishes KV event batches on ZMQ as vLLM's ``ZmqEventPublisher`` does, so one subscriber reads both.

Frames: ``(topic, sequence number as 8 bytes big-endian, msgpack batch)`` on a PUB socket. With a
replay endpoint, a ROUTER socket answers ``(client, b"", start sequence)`` with every kept batch from
that number, ``(client, b"", topic, seq, payload)`` each, then ``(client, b"", b"", -1, b"")``.

Events carry the prompts' token ids: the sockets bind loopback by default, and binding another
address is logged as a warning (a router's subscriber cannot authenticate: keep the port private, as
vLLM's). The replay socket answers at most ``_REPLAYS_PER_S`` requests a second; more are dropped.

The cache never waits for it: ``put`` appends to a bounded queue (past ``max_queue_size`` events
are dropped and counted) and one thread batches, encodes and sends; a subscriber that lags past the
socket's high-water mark loses batches (ZMQ drops them; counted as ``dropped_batches`` when the
send would block). Sockets live in that thread only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from .base import KVEvent
from .wire import encode_batch

__all__ = ["ZmqEventPublisher"]

log = logging.getLogger("hicache.events")

_END = (-1).to_bytes(8, "big", signed=True)
_REPLAYS_PER_S = 20
_LOCAL = ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:", "ipc://", "inproc://")


def _warn_if_public(endpoint: str | None) -> None:
    if endpoint is not None and not endpoint.startswith(_LOCAL):
        log.warning("KV events on %s: they carry the prompts' token ids and subscribers are not authenticated; "
                    "keep that address private", endpoint)


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        hwm: int = 100_000,
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        batch_events: int = 512,
        batch_interval_s: float = 0.05,
        data_parallel_rank: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        self.batch_events = batch_events
        self.batch_interval_s = batch_interval_s
        self.data_parallel_rank = data_parallel_rank
        self._queue: deque[KVEvent] = deque()
        self._replay: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        #: Where the sockets are bound (a ``*`` port resolved), once started.
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None
        self.next_seq = 0  # the sequence number of the next batch
        self.dropped_events = 0  # the queue was full
        self.dropped_batches = 0  # the PUB socket would have blocked (every subscriber at its HWM)
        self.sent_batches = 0
        self.replays = 0
        self.refused_replays = 0  # past _REPLAYS_PER_S
        self._replay_window = 0.0
        self._replays_now = 0
        self._cycles = 0  # passes of the thread's loop, each sending all it found queued
        self._cycled = threading.Condition()

    # -- the cache's side -----------------------------------------------------------------------

    def put(self, events: Sequence[KVEvent]) -> bool:
        """Queue events; never blocks. Past ``max_queue_size`` they are dropped, counted, and
        False is returned."""
        if not self.has_room(len(events)):
            self.dropped_events += len(events)
            return False
        self._queue.extend(events)  # deque.extend is atomic under the GIL
        if len(self._queue) >= self.batch_events:
            self._wake.set()
        return True

    def has_room(self, events: int) -> bool:
        return len(self._queue) + events <= self.max_queue_size

    def start(self) -> None:
        """Bind the sockets (in the publisher's thread) and start it; a bad endpoint raises here."""
        _warn_if_public(self.endpoint)
        _warn_if_public(self.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            error, self._error = self._error, None
            self._thread.join()
            raise error

    def flush(self, timeout_s: float = 5.0) -> int:
        """Wait until everything queued before this call is sent; the next batch's sequence number."""
        with self._cycled:
            target = self._cycles + 2  # the pass under way may have started before the last put
            self._wake.set()
            if not self._cycled.wait_for(lambda: self._cycles >= target or self._thread is None, timeout_s):
                raise TimeoutError("the KV event publisher did not send its queue in time")
        return self.next_seq

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self._thread = None

    # -- the publisher's thread -----------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.ROUTER_HANDOVER, 1)
                replay.bind(self.replay_endpoint)
                self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self._error = exc
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            self._started.set()
            return
        self._started.set()
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                stopping = self._stop.is_set()
                if replay is not None:
                    if poller.poll(0):
                        self._answer(replay)
                if self._queue:
                    self._send(pub)
                with self._cycled:
                    self._cycles += 1
                    self._cycled.notify_all()
                if stopping and not self._queue:
                    break
                if replay is not None:
                    # wait for a request or the next batch, whichever comes first
                    if poller.poll(int(self.batch_interval_s * 1000) or 1):
                        continue
                else:
                    self._wake.wait(self.batch_interval_s)
                self._wake.clear()
        except Exception:  # pragma: no cover - surfaced in the log; the cache goes on without events
            log.exception("KV event publisher failed; no more events are published")
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _send(self, pub: zmq.Socket) -> None:
        while self._queue:
            events = []
            while self._queue and len(events) < self.batch_events:
                events.append(self._queue.popleft())
            payload = encode_batch(time.time(), events, self.data_parallel_rank)
            seq = self.next_seq
            self.next_seq += 1
            self._replay.append((seq, payload))
            try:
                pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                self.sent_batches += 1
            except zmq.Again:
                self.dropped_batches += 1

    def _answer(self, replay: zmq.Socket) -> None:
        while True:
            try:
                frames = replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: ignored, nothing revealed
            now = time.monotonic()
            if now - self._replay_window > 1.0:
                self._replay_window, self._replays_now = now, 0
            if self._replays_now >= _REPLAYS_PER_S:
                self.refused_replays += 1
                continue
            self._replays_now += 1
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in list(self._replay):
                if seq >= first:
                    replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", b"", _END, b""))
