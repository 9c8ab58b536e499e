"""The pages a benchmark's storage tiers write into its ``--out`` folder, removed when the run ends.

They are scratch: every run starts its tiers cold, and the figures are in ``results.json``. They are
also large (about 2 GB a ``bench serve``, 0.5 GB a ``bench vllm``, 2.5 GB a ``make run``), and runs
that left them behind have filled a disk. ``--keep-pages`` keeps them, to look into with
``hicache inspect``.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["add_keep_pages_argument", "pages_removed"]


def add_keep_pages_argument(group: Any) -> None:
    group.add_argument("--keep-pages", action="store_true",
                       help="keep the file tiers' pages in --out after the run (removed by default)")


@contextmanager
def pages_removed(folders: Iterable[Path], keep: bool = False) -> Iterator[None]:
    """Run the body, then remove ``folders`` (the ones the benchmark itself writes; nothing else in
    ``--out`` is touched), also when the body fails or is interrupted: a run cut short leaves as much."""
    try:
        yield
    finally:
        if not keep:
            freed = sum(_remove(folder) for folder in folders if folder.is_dir() and not folder.is_symlink())
            if freed:
                print(f"removed {freed / 2**30:.2f} GiB of tier pages (--keep-pages keeps them)", file=sys.stderr)


def _remove(folder: Path) -> int:
    """Remove ``folder``; return the bytes its files held. Never raises: it runs in a ``finally``,
    where an error would hide the run's own."""
    size = 0
    for path in folder.rglob("*"):
        try:
            size += path.lstat().st_size if path.is_file() and not path.is_symlink() else 0
        except OSError:
            pass  # gone meanwhile
    shutil.rmtree(folder, ignore_errors=True)
    return size
