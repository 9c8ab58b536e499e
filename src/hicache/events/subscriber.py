"""A KV event subscriber: batches in sequence order, gaps filled from the publisher's replay socket.

What a router does per instance (llm-d's KV-events pool, Dynamo's ZMQ listener): SUB to the PUB
endpoint, and when a batch's sequence number skips (the subscriber joined late, or its socket
dropped batches past the high-water mark), ask the replay endpoint for the missing ones. Works with
vLLM's publisher and hicache's alike. Synchronous, one thread; every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from .base import KVEvent
from .wire import decode_batch

__all__ = ["EventSubscriber"]

_END = (-1).to_bytes(8, "big", signed=True)


class EventSubscriber:
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 on_batch: Callable[[int, list[KVEvent]], None]) -> None:
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.on_batch = on_batch
        self.next_seq = 0  # the batch expected next
        self.replayed = 0  # batches got from the replay socket
        self.missed = 0  # batches neither the socket nor the replay could give (outside its window)

    def close(self) -> None:
        self._sub.close(0)

    def poll(self, timeout_s: float) -> int:
        """Take the batches that arrive within ``timeout_s`` (at least one wait); their count."""
        n = 0
        wait_ms = max(1, int(timeout_s * 1000))
        while self._sub.poll(wait_ms):
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            n += self._take(int.from_bytes(seq_bytes, "big"), payload)
            wait_ms = 0
        return n

    def until(self, seq: int, timeout_s: float = 10.0) -> None:
        """Take batches until every one before ``seq`` is in; TimeoutError past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq < seq:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"KV events: batch {self.next_seq} of {seq} never came")
            if not self.poll(min(left, 0.05)) and self.replay_endpoint is not None:
                self._replay(self.next_seq, seq)  # quiet, yet behind: joined late or lost them

    def _take(self, seq: int, payload: bytes) -> int:
        if seq < self.next_seq:
            return 0  # already had it (from a replay)
        if seq > self.next_seq:
            if self.replay_endpoint is not None:
                self._replay(self.next_seq, seq)
            if seq > self.next_seq:
                self.missed += seq - self.next_seq
        _, events, _ = decode_batch(payload)
        self.on_batch(seq, events)
        self.next_seq = seq + 1
        return 1

    def _replay(self, first: int, stop: int, timeout_s: float = 2.0) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", first.to_bytes(8, "big")))
            while sock.poll(int(timeout_s * 1000)):
                frames = sock.recv_multipart()
                _, _topic, seq_bytes, payload = frames
                if seq_bytes == _END:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if self.next_seq <= seq < stop:
                    if seq > self.next_seq:
                        self.missed += seq - self.next_seq
                    _, events, _ = decode_batch(payload)
                    self.on_batch(seq, events)
                    self.next_seq = seq + 1
                    self.replayed += 1
        finally:
            sock.close(0)
