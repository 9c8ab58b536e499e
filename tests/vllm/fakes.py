"""Fault fakes for the vLLM tests, named as such: file tiers that stall.

* ``FailingReadFileBackend``: ``exists`` answers from the real files (so the scheduler is promised
  the pages); every read waits ``delay_s`` (room to abort a request while its prefetch is in
  flight) and then raises, like a disk or network share that lists files it can no longer read.
* ``SlowWriteFileBackend``: every write call waits ``delay_s`` before writing the real files, like
  a slow network share: writes pile up, so a shutdown finds pages still owed to storage.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from hicache.tiers.storage.base import PageIO
from hicache.tiers.storage.file import FileBackend


class FailingReadFileBackend(FileBackend):
    kind = "failing_read_file"

    class Settings(FileBackend.Settings):
        delay_s: float = 1.0

    settings: Settings

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        await anyio.sleep(self.settings.delay_s)
        raise OSError("injected read failure")


class SlowWriteFileBackend(FileBackend):
    kind = "slow_write_file"

    class Settings(FileBackend.Settings):
        delay_s: float = 1.0

    settings: Settings

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        await anyio.sleep(self.settings.delay_s)
        return await super()._set(keys, pages)
