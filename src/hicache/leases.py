"""Leases: what a caller holds while it uses pages of the cache.

Both are async context managers. While one is held its pages cannot be evicted or freed; on exit
(normal, error or cancellation) everything it held is released. Nothing here is reference-counted
by hand by the caller.

* ``RetrieveView`` (from ``HiCache.retrieve``): the KV of the longest cached prefix, on the device
  tier, arriving layer by layer.
* ``SlotReservation`` (from ``HiCache.reserve``): fresh device pages (or host pages, with
  ``tier="host"``) an engine writes KV into in place (zero-copy), then commits to the cache under
  their token ids.
* ``HeldPrefix`` (from ``HiCache.hold``): the cached prefix pinned where it lies (host or device
  pages), for an engine that copies KV into its own memory itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

from .errors import InvalidRequestError, WorkerFailedError

if TYPE_CHECKING:
    from .controller.jobs import LoadJob
    from .radix_tree import Pin
    from .tiers.base import MemoryTier
    from .tiers.device import DevicePool

__all__ = ["RetrieveView", "SlotReservation", "HeldPrefix", "Lease"]


class _PinnedPrefix:
    """A prefix held by a radix-tree pin: ``release`` unpins it once, however often it is called."""

    _pin: Pin | None
    _released: bool

    def release(self) -> None:
        """Unpin the prefix (idempotent); called when the ``async with`` block exits."""
        if not self._released:
            self._released = True
            if self._pin is not None:
                self._pin.release()

    async def arelease(self) -> None:
        self.release()


class RetrieveView(_PinnedPrefix):
    """The cached prefix of a retrieve, pinned on the device tier until the block exits.

    ``tokens`` is the prefix length (whole pages). ``wait_layer(i)`` returns once layer ``i`` is on
    the device (earlier layers may be read while later ones still load); ``layer(i)`` returns the
    per-component tensors ``[tokens, H, D]`` (``(k, v)``; ``(latent,)`` for MLA) as a copy.
    Engines that read the device pool directly use ``device_pages`` / ``slot_indices`` instead.
    """

    def __init__(
        self,
        *,
        tokens: int,
        by_tier: Mapping[str, int],
        device_pages: list[int],
        jobs: list[LoadJob],
        pin: Pin | None,
        device_pool: DevicePool,
        read_layer: Callable[[list[int], int], tuple[torch.Tensor, ...]],
        check_open: Callable[[], None],
    ) -> None:
        self.tokens = tokens
        self.by_tier = MappingProxyType(dict(by_tier))
        self.device_pages = device_pages
        self._jobs = jobs
        self._pin = pin
        self._device_pool = device_pool
        self._read_layer = read_layer
        self._check_open = check_open
        self._released = False
        self._num_layers = device_pool.geometry.num_layers

    @property
    def tier(self) -> DevicePool:
        """The device tier the prefix is on (``tier.layer_view(layer)[device_pages]``)."""
        return self._device_pool

    @property
    def slot_indices(self) -> torch.Tensor:
        """Token slot indices of the prefix in ``cache.device_kv`` viewed as ``[C, L, slots, H, D]``."""
        return self._device_pool.token_slots(self.device_pages)

    def _check_layer(self, layer: int) -> None:
        if self._released:
            raise InvalidRequestError("this RetrieveView was released when its `async with` block exited")
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self._num_layers:
            raise InvalidRequestError(f"layer must be in [0, {self._num_layers}), got {layer}")

    async def wait_layer(self, layer: int) -> None:
        """Return once ``layer`` of the whole prefix is on the device tier."""
        self._check_layer(layer)
        for job in self._jobs:
            await job.wait_layer(layer)
            if job.error is not None:
                self._check_open()  # raises WorkerFailedError when the load worker died
                raise WorkerFailedError(f"load-back failed: {job.error!r}") from job.error

    async def wait_all(self) -> None:
        await self.wait_layer(self._num_layers - 1)
        for job in self._jobs:
            await job.finished.wait()

    def is_layer_ready(self, layer: int) -> bool:
        self._check_layer(layer)
        return all(job.is_ready(layer) for job in self._jobs)

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Per-component KV of ``layer``: ``(k, v)`` each ``[tokens, H, D]`` (MLA: ``(latent,)``)."""
        if not self.is_layer_ready(layer):
            raise InvalidRequestError(f"layer {layer} has not arrived yet: `await view.wait_layer({layer})` first")
        return self._read_layer(self.device_pages, layer)

    def __repr__(self) -> str:
        return f"<RetrieveView tokens={self.tokens} by_tier={dict(self.by_tier)} released={self._released}>"


class Lease:
    """Turns an ``acquire`` coroutine and a ``release`` method into an async context manager."""

    def __init__(self, acquire: Callable[[], Awaitable[Any]]) -> None:
        self._acquire = acquire
        self._value: Any = None

    async def __aenter__(self) -> Any:
        if self._value is not None:
            raise RuntimeError("a lease can be entered only once")
        self._value = await self._acquire()
        return self._value

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._value.arelease()


class SlotReservation:
    """Fresh pages of one memory tier reserved for an engine to write KV into in place.

    Write the KV of pages ``first_page..first_page + len(pages)`` of a token sequence into
    ``cache.device_kv[:, :, pages]`` (or through ``slot_indices``; host pages: through
    ``tier.layer_view``), then ``await commit(tokens, first_page)``: the pages join the cache
    (those already cached by then are freed instead). Pages not committed are freed when the block
    exits.
    """

    def __init__(
        self,
        pages: list[int],
        tier: MemoryTier,
        commit: Callable[[SlotReservation, Any, int, int, Iterable[int] | None], Awaitable[int]],
        free: Callable[[list[int]], None],
    ) -> None:
        self.pages = pages
        self.tier = tier  # the tier the pages belong to (the device pool unless reserved on the host)
        self._commit = commit
        self._free = free
        self._owned = True

    @property
    def slot_indices(self) -> torch.Tensor:
        token_slots = getattr(self.tier, "token_slots", None)
        if token_slots is None:
            raise InvalidRequestError(f"slot_indices address the device pool; these pages are on the {self.tier.name} tier")
        return token_slots(self.pages)

    async def commit(
        self, tokens: Any, first_page: int = 0, *, priority: int = 0, checkpoints: Iterable[int] | None = None
    ) -> int:
        """Hand the pages to the cache as pages ``first_page..`` of ``tokens``; return tokens added.

        A model with recurrent layers names the ``checkpoints`` its pages carry, as ``HiCache.store``
        does (the engine wrote each one in the ``state`` layers of the page ending there); the
        other pages are placed thin. Bad arguments raise before anything changes; the reservation
        then still holds its pages.
        """
        if not self._owned:
            raise InvalidRequestError("this reservation was already committed or released")
        return await self._commit(self, tokens, first_page, priority, checkpoints)

    def hand_over(self) -> list[int]:
        """Give up ownership of the pages (the cache takes them); called once, by commit."""
        assert self._owned
        self._owned = False
        return self.pages

    async def arelease(self) -> None:
        if self._owned:
            self._owned = False
            self._free(self.pages)


class HeldPrefix(_PinnedPrefix):
    """A cached prefix pinned in the tiers where it lies, until the block exits (``HiCache.hold``).

    Nothing is copied: an engine that copies KV into its own memory reads the pages in place, layer
    by layer (``tier.layer_view(layer)[pages]``, ``[pages, C, page_size * H * D]``). ``tokens`` is
    the cached prefix (whole pages, from token 0); ``start`` the tokens the caller said it holds
    already; ``segments`` lists, in order, the ``(tier, pages)`` holding tokens ``start..tokens``;
    ``by_tier`` says which tier supplied them (a storage tier's name for pages a prefetch brought
    from it into host memory). ``thin``: ``(first, end)`` token-page ranges (from page 0) held
    *thin*: their sliding-window layers' KV is absent (zeros), as a layer-split storage tier
    returns pages far from any prefix end. The prefix's end never needs them (its window is
    whole); an engine that keeps KV behind the window must not take them for real.
    """

    def __init__(
        self,
        *,
        tokens: int,
        start: int,
        by_tier: Mapping[str, int],
        segments: list[tuple[MemoryTier, list[int]]],
        pin: Pin | None,
        check_open: Callable[[], None],
        thin: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.tokens = tokens
        self.start = start
        self.by_tier = MappingProxyType(dict(by_tier))
        self.segments = segments
        self.thin = thin
        self._pin = pin
        self._check_open = check_open
        self._released = False

    @property
    def num_pages(self) -> int:
        """Pages held after ``start``."""
        return sum(len(pages) for _, pages in self.segments)

    def check(self) -> None:
        """Raise unless the pages may still be read (held, and the cache open)."""
        if self._released:
            raise InvalidRequestError("this HeldPrefix was released when its `async with` block exited")
        self._check_open()

    def __repr__(self) -> str:
        where = [(tier.name, len(pages)) for tier, pages in self.segments]
        return f"<HeldPrefix tokens={self.tokens} start={self.start} pages={where} released={self._released}>"
