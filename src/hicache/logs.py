"""Logging: one logger per component under ``hicache.``, rate-limited repeats, optional JSON lines.

Loggers are named after their module (``hicache.controller.controller``, ``hicache.tiers.storage.tier``,
``hicache.tiers.storage.file``, ``hicache.metrics.server`` ...), all children of ``hicache``, so an
application sets levels per component with the standard ``logging`` module. hicache installs no
handler unless the config's ``logging.format`` asks for one (``configure``): a library leaves
logging to its application.

What is logged at each level (docs/operating.md, "Logs", has the full list):

* ``ERROR``: a background worker failed and the cache is unusable (``WorkerFailedError`` follows).
* ``WARNING``: something an operator should act on, each naming the tier and the numbers: a storage
  tier stopped answering (once, until it answers again, then once more), pages failed verification
  (rate-limited per reason), pages lost at close, a page file that cannot be written, a shard folder
  that is a link, a Mooncake client that had to be set up again.
* ``INFO``: changes an operator made or should know of: a storage tier attached or detached (with
  what the detach waited for, cancelled and how long it took), the metrics/admin server's address,
  each admin request.
* ``DEBUG``: per-call detail (every storage failure while a tier stays down, partial batches).

``RateLimited`` keeps a warning that can repeat per page (a corrupt page, a failed write) to one line
per ``repeat_interval_s`` and per kind, and says how many were suppressed in between.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["JsonFormatter", "RateLimited", "configure", "repeat_interval_s", "set_repeat_interval"]

_HANDLER_NAME = "hicache-config"
_repeat_interval_s = 60.0

# The attributes every LogRecord has; anything else was passed with ``extra=`` and goes into JSON.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}


def repeat_interval_s() -> float:
    return _repeat_interval_s


def set_repeat_interval(seconds: float) -> None:
    global _repeat_interval_s
    _repeat_interval_s = seconds


class RateLimited:
    """Log a repeating message once per interval and kind, then say how many were suppressed.

    ``kind`` groups the repeats (a corrupt page's reason, a tier's name): a new kind is always
    logged. Used on the event loop thread (or from worker threads: a lost race costs one extra line).
    """

    def __init__(self, logger: logging.Logger, interval_s: float | None = None) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: Any) -> None:
        self.log(logging.WARNING, kind, message, *args)

    def log(self, level: int, kind: str, message: str, *args: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        interval = _repeat_interval_s if self.interval_s is None else self.interval_s
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._suppressed.pop(kind, 0)
        if skipped:
            message += " (%d more like it in the last %.3g s not logged)"
            args = (*args, skipped, interval)
        self.logger.log(level, message, *args)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str | None, fmt: str | None, repeat_s: float, stream: Any = None) -> None:
    """Apply the config's ``logging`` section to the ``hicache`` logger (idempotent).

    ``level`` None leaves the level alone; ``fmt`` None installs no handler (the application's
    logging applies), ``text`` or ``json`` installs one on ``stream`` (stderr), replacing the one
    a previous call installed.
    """
    global _repeat_interval_s
    _repeat_interval_s = repeat_s
    root = logging.getLogger("hicache")
    if level is not None:
        root.setLevel(level)
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    if fmt is None:
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root.addHandler(handler)
