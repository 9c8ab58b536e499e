"""``PeerPair``: a producer and a consumer ``nixl-peer`` backend in this process, as one backend.

A test harness, not a fake: both are real backends with real NIXL agents, and every read goes over
UCX from the producer's arena (the consumer has none of its own). Writes go to the producer, reads,
probes and deletes through the consumer, so the contract suite (``test_storage_backends``) and the
codec suite check the transport end to end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.config import ByteSize
from hicache.tiers.storage.base import BackendSettings, PageIO, StorageBackend
from hicache.tiers.storage.nixl.peer import NixlPeerBackend


class PeerPair(StorageBackend):
    kind = "nixl-peer"
    variable_size_pages = True

    class Settings(BackendSettings):
        capacity: ByteSize = 64 * 1024**2

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.producer = NixlPeerBackend(listen="127.0.0.1:0", capacity=self.settings.capacity,
                                        timeout_s=self.settings.timeout_s)
        self.consumer: NixlPeerBackend | None = None

    async def _open(self) -> None:
        await self.producer.open()
        assert self.producer.address is not None
        host, port = self.producer.address
        self.consumer = NixlPeerBackend(peers=[f"{host}:{port}"], timeout_s=self.settings.timeout_s)
        await self.consumer.open()

    async def _aclose(self) -> None:
        if self.consumer is not None:
            await self.consumer.aclose()
        await self.producer.aclose()

    def _reader(self) -> NixlPeerBackend:
        assert self.consumer is not None
        return self.consumer

    async def _exists(self, keys: Sequence[bytes]) -> int:
        return await self._reader().exists(keys)

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        return await self._reader().get(keys, into)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        return await self._reader().get(keys, into, sizes=sizes)

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        done = await self.producer.set(keys, pages)
        self.evicted_pages = self.producer.stats().evicted_pages
        return done

    async def _delete(self, keys: Sequence[bytes]) -> None:
        await self._reader().delete(keys)  # forwarded to the producer

    async def _clear(self) -> None:
        await self.producer.clear()

    def _usage(self) -> tuple[int | None, int | None, int | None]:
        return self.producer._usage()
