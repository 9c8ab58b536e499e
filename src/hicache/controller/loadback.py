"""Bringing a cached prefix up to the device for ``retrieve``, by runs through the host.

``bring_up`` pins the longest prefix the tiers hold and starts loading its host-only part into
device pages (layer by layer, by the load worker): what ``retrieve`` leases. Pages that only
storage holds come into the host first (the prefetcher, as its policy allows).

A prefix need not fit in the host. A retrieve pins at most the host pages leases may pin
(``Evictor.pin_room``: the host keeps room for pages leaving the device, which is how the device
makes room for the load); the rest of a host-only prefix is left unpinned (``_trim_to_pin_room``).
And a prefetch stops when that room is full (``StorageRest``). Either way the retrieve loads the
run it has, waits for that load (its host pages may then go), and asks for the next run, from
the host or from storage, within the prefetch policy's one wait. It is shorter than what the tiers
held only when the device is full of leased pages (``_fit_load``) or the host stays full of other
requests' pins; ``short_retrieves`` counts both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..keys import TokenBytes
from ..radix_tree import Pin, TreeNode
from .jobs import LoadJob

if TYPE_CHECKING:
    from .controller import CacheController

__all__ = ["Brought", "bring_up", "restorable_path"]


@dataclass
class Brought:
    """A prefix pinned for a retrieve: its nodes, the pin (the caller's to release), the load jobs
    filling its host-only part, the pages they load, and those a prefetch brought, by tier."""

    path: list[TreeNode] = field(default_factory=list)
    pin: Pin | None = None
    jobs: list[LoadJob] = field(default_factory=list)
    loaded: int = 0
    from_storage: dict[str, int] = field(default_factory=dict)


async def bring_up(ctl: CacheController, tb: TokenBytes) -> Brought:
    """Pin the longest cached prefix of ``tb`` and load its host-only part, by runs (module docs)."""
    rest = await ctl.prefetcher.before_retrieve(tb)
    path = ctl.tree.match(tb, split=True).path
    out = Brought(pin=Pin(path[-1]) if path else None)
    short = False
    seen = _pages(path)  # the longest prefix memory held for us (a trim may let some go)
    try:
        path, out.pin, capped = _trim_to_pin_room(ctl, path, out.pin)
        room_wait = ctl.evictor.host_waiter()
        while True:
            path, out.pin, job, sources, short = await _load_host_part(ctl, path, out.pin)
            if job is not None:
                out.jobs.append(job)
                out.loaded += len(job.device_pages)
                for name, pages in sources.items():
                    out.from_storage[name] = out.from_storage.get(name, 0) + pages
            if short or (rest is None and not capped):
                break
            # Runs through a small host: the prefetch stopped with the host full, or we pinned only
            # part of the host-only pages. Once this run is on the device its host pages may go,
            # and the next run can come up (from memory, or from storage).
            if job is not None:
                await job.finished.wait()
                if job.error is not None:
                    break
            rest = await ctl.prefetcher.before_retrieve(tb, rest)
            longer = ctl.tree.match(tb, split=True).path
            seen = max(seen, _pages(longer))
            if _pages(longer) <= _pages(path):
                # Nothing came up: other leases hold the host. Something in flight may release it.
                if rest is not None and await room_wait.next():
                    continue
                break
            old, out.pin = out.pin, Pin(longer[-1])  # extends our pinned path (pinned throughout)
            if old is not None:
                old.release()
            before = _pages(path)
            path, out.pin, capped = _trim_to_pin_room(ctl, longer, out.pin)
            if _pages(path) <= before and not await room_wait.next():
                break  # pins hold all the host may give them, and nothing in flight will release any
        # Runs may pass thin pages (sliding layers absent); the hit ends where a window is whole.
        before = _pages(path)
        path, out.pin = restorable_path(ctl, path, out.pin)
        _forget_tail(out, before - _pages(path))
    except BaseException:
        if out.pin is not None:
            out.pin.release()
        raise
    held = ctl.tree.restorable(path, max(seen, rest.end_page if rest is not None else 0))
    if not short and _pages(path) < held:
        # Pages the tiers held that could not be brought up within the policy's wait (the host full
        # of other pins, or a trimmed tail that left memory with no storage tier to come back from).
        ctl.counters.short_retrieves += 1
        ctl.counters.short_retrieve_tokens += (held - _pages(path)) * ctl.tree.page_size
    out.path = path
    return out


def _forget_tail(out: Brought, pages: int) -> None:
    """A trim took ``pages`` off the end of the hit: loaded last, they leave the counts first."""
    if pages <= 0:
        return
    out.loaded = max(0, out.loaded - pages)
    excess = sum(out.from_storage.values()) - out.loaded
    for name in reversed(list(out.from_storage)):
        if excess <= 0:
            break
        take = min(excess, out.from_storage[name])
        out.from_storage[name] -= take
        excess -= take


def restorable_path(ctl: CacheController, path: list[TreeNode], pin: Pin | None) -> tuple[list[TreeNode], Pin | None]:
    """``path`` cut where a hit may end (no thin page in the window before it), re-pinned."""
    pages = _pages(path)
    keep = ctl.tree.restorable(path, pages)
    if keep == pages:
        return path, pin
    kept = _first_pages(ctl, path, keep)
    if pin is None:
        return kept, None
    new = Pin(kept[-1]) if kept else None
    pin.release()
    return kept, new


def _first_pages(ctl: CacheController, nodes: list[TreeNode], pages: int) -> list[TreeNode]:
    """The nodes holding the first ``pages`` pages of ``nodes`` (the last one split to fit)."""
    kept: list[TreeNode] = []
    for node in nodes:
        if pages <= 0:
            break
        if node.num_pages > pages:
            node = ctl.tree.split(node, pages)
        kept.append(node)
        pages -= node.num_pages
    return kept


def _trim_to_pin_room(ctl: CacheController, path: list[TreeNode], pin: Pin | None) -> tuple[list[TreeNode], Pin | None, bool]:
    """Hold at most as many host-only pages of ``path`` as leases may pin (``Evictor.pin_room``):
    pinned beyond that, they would keep the host from taking the device's spills, and so the
    device from making room to load them. Returns the path kept, its pin, and whether it was cut."""
    host_only = [nd for nd in path if nd.device is None]  # a suffix: device residency is prefix-closed
    held = _pages(host_only)
    room = ctl.evictor.pin_room() + held  # our pin is among the leases counted
    if held <= room:
        return path, pin, False
    kept = path[: len(path) - len(host_only)] + _first_pages(ctl, host_only, room)
    new = Pin(kept[-1]) if kept else None
    if pin is not None:
        pin.release()
    return kept, new, True


async def _load_host_part(
    ctl: CacheController, path: list[TreeNode], pin: Pin | None
) -> tuple[list[TreeNode], Pin | None, LoadJob | None, dict[str, int], bool]:
    """Start loading the host-only part of ``path`` (pinned by ``pin``) into device pages.

    Returns the path (shorter if the device is full of leased pages: ``_fit_load``), the pin that
    holds it now, the load job (None: nothing to load), the pages it loads that a prefetch brought
    from storage (by tier), and whether the path was cut short.
    """
    host_only = [nd for nd in path if nd.device is None]
    if not host_only:
        return path, pin, None, {}, False
    dev = await ctl.evictor.alloc_device(_pages(host_only), partial=True)
    # While we awaited, other calls may have split nodes of the path or started loading some of
    # them; the pin kept them all, so re-derive the path from its deepest node.
    path = ctl.tree.path_to(path[-1])
    host_only = [nd for nd in path if nd.device is None]
    wanted = _pages(host_only)
    path, host_only, dev = _fit_load(ctl, path, host_only, dev)
    cut = len(dev) < wanted
    if pin is not None and (not path or path[-1] is not pin.node):
        old, pin = pin, (Pin(path[-1]) if path else None)
        old.release()
    if not host_only:
        return path, pin, None, {}, cut
    sources = _take_sources(host_only)
    try:
        job = await ctl.submit_load(host_only, dev, path[-1])
    except BaseException:
        if pin is not None:
            pin.release()  # the caller holds the pin it passed (released already if replaced)
        raise
    # Awaiting the queue let other calls split nodes again: re-derive once more.
    return ctl.tree.path_to(pin.node if pin is not None else None), pin, job, sources, cut


def _fit_load(
    ctl: CacheController, path: list[TreeNode], host_only: list[TreeNode], dev: list[int]
) -> tuple[list[TreeNode], list[TreeNode], list[int]]:
    """Trim the host-only tail of ``path`` to the device pages we got; free the surplus."""
    need = _pages(host_only)
    if len(dev) >= need:
        ctl.device.allocator.free(dev[need:])
        return path, host_only, dev[:need]
    # The device is full of leased pages: serve a shorter prefix, and say so.
    ctl.counters.short_retrieves += 1
    ctl.counters.short_retrieve_tokens += (need - len(dev)) * ctl.tree.page_size
    kept: list[TreeNode] = []
    room = len(dev)
    for node in host_only:
        if room >= node.num_pages:
            kept.append(node)
            room -= node.num_pages
            continue
        if room > 0:
            kept.append(ctl.tree.split(node, room))  # load the prefix that fits
            room = 0
        break
    cut = path.index(host_only[0])
    path = path[:cut] + kept
    used = _pages(kept)
    ctl.device.allocator.free(dev[used:])
    return path, kept, dev[:used]


def _take_sources(loaded: list[TreeNode]) -> dict[str, int]:
    """Pages among ``loaded`` that a prefetch brought from storage, by tier (counted once)."""
    out: dict[str, int] = {}
    for node in loaded:
        if node.source is not None:
            out[node.source] = out.get(node.source, 0) + node.num_pages
            node.source = None
    return out


def _pages(path: list[TreeNode]) -> int:
    return sum(node.num_pages for node in path)
