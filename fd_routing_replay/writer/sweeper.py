"""The writer's retention sweeper: :func:`fd_routing_replay.store.retention.apply_retention` on a
timer (a header sweep, or, where the store expires records itself, a purge of the index
entries of what expired plus ``max_bytes``).

Started by the writer of rank dp0-tp0 when ``retention.ttl_s`` or ``retention.max_bytes``
is set (one sweeper per namespace, not one per rank); a failing sweep is logged (rate
limited) and tried again at the next interval.  Its own store connection, so it never
waits behind the writer's queue.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from fd_routing_replay.store.retention import apply_retention
from fd_routing_replay.writer.logs import RateLimitedLog

__all__ = ["Sweeper"]

log = logging.getLogger("fd_routing_replay.writer")


class Sweeper:
    """A daemon thread sweeping the namespace every ``retention.sweep_interval_s``."""

    def __init__(self, store_config: Any, retention: Any) -> None:
        self.store_config = store_config
        self.retention = retention
        self.sweeps = 0
        self.deleted = 0
        self.purged = 0
        self._stop = threading.Event()
        self._errors = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name="fd-rr-retention", daemon=True)

    @classmethod
    def start_for(cls, store_config: Any, retention: Any, identity: Any) -> Sweeper | None:
        """A started sweeper when retention asks for one and this is rank dp0-tp0."""
        if retention is None or not (retention.ttl_s or retention.max_bytes):
            return None
        if (identity.dp_rank, identity.tp_rank) != (0, 0):
            return None
        sweeper = cls(store_config, retention)
        sweeper._thread.start()
        return sweeper

    def _run(self) -> None:
        from fd_routing_replay.store import open_store

        store = None
        while not self._stop.wait(self.retention.sweep_interval_s):
            try:
                if store is None:
                    store = open_store(self.store_config)
                report = apply_retention(store, ttl_s=self.retention.ttl_s,
                                         max_bytes=self.retention.max_bytes)
                self.sweeps += 1
                self.deleted += report.deleted
                self.purged += report.purged
            except Exception as exc:  # noqa: BLE001 - retried at the next interval
                self._errors.log(logging.ERROR, "retention", "routing writer: retention sweep of "
                                 "%s failed (retried in %g s): %r", self.store_config.namespace,
                                 self.retention.sweep_interval_s, exc)
        if store is not None:
            store.close()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
