"""Fault fakes for the vLLM tests, named as such: file tiers that stall or fail.

* ``FailingReadFileBackend``: ``exists`` answers from the real files (so the scheduler is promised
  the pages); every read waits ``delay_s`` (room to abort a request while its prefetch is in
  flight) and then raises, like a disk or network share that lists files it can no longer read.
* ``SlowWriteFileBackend``: every write call waits ``delay_s`` before writing the real files, like
  a slow network share: writes pile up, so a shutdown finds pages still owed to storage.
* ``OneRankFaultFileBackend``: fails on one TP rank only, as a switch file says.
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


class OneRankFaultFileBackend(FileBackend):
    """Fault fake: a real file tier that fails on one TP rank only, as a switch file says.

    The switch (``switch``: a path) holds ``exists`` (that rank's tier cannot list pages: every call
    raises), ``reads`` (it lists them, but every read raises) or nothing (healthy); it is read on
    every call, so a test turns the fault on between requests. The rank is vLLM's TP rank of the
    worker process the tier lives in.
    """

    kind = "one_rank_fault_file"

    class Settings(FileBackend.Settings):
        switch: str
        fail_rank: int = 1

    settings: Settings

    def _fault(self) -> str:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != self.settings.fail_rank:
            return ""
        try:
            with open(self.settings.switch) as f:
                return f.read().strip()
        except FileNotFoundError:
            return ""

    async def _exists(self, keys: Sequence[bytes]) -> int:
        if self._fault() == "exists":
            raise OSError("injected failure: this rank's tier is unreachable")
        return await super()._exists(keys)

    async def _read(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        if self._fault() in ("exists", "reads"):  # every read, sized or not, comes here
            raise OSError("injected read failure on this rank")
        return await super()._read(keys, into, sizes)
