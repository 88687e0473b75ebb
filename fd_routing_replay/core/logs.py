"""Log lines that repeat while a fault lasts, limited to one per interval.

A store that is down and a disk that is full make the writer fail the same way many
times a second.  :class:`RateLimitedLog` lets the first line of each kind through, then
at most one per ``interval_s``, each saying how many similar lines it stood for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ERROR_LOG_INTERVAL_S", "RateLimitedLog"]

ERROR_LOG_INTERVAL_S = 30.0
"""Default interval between two lines of the same kind."""


class RateLimitedLog:
    """At most one line per ``interval_s`` for each ``kind``; thread-safe."""

    def __init__(self, logger: logging.Logger, interval_s: float = ERROR_LOG_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, kind: str, message: str, *args: Any) -> bool:
        """Log ``message % args`` unless a line of ``kind`` went out less than
        ``interval_s`` ago; return True when it was logged."""
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return False
            suppressed = self._suppressed.pop(kind, 0)
            self._last[kind] = now
        if suppressed:
            message += f" ({suppressed} similar line(s) suppressed in the last {now - last:.0f}s)"
        self.logger.log(level, message, *args)
        return True

    def reset(self, kind: str) -> int:
        """Forget ``kind`` (its fault is over): the next line goes out at once.  Returns
        how many lines were suppressed since the last one logged."""
        with self._lock:
            self._last.pop(kind, None)
            return self._suppressed.pop(kind, 0)
