"""What a submit waits for when the writer is full, and for how long (``full_policy``).

``block`` waits up to ``block_timeout_s`` for ring space; a record headed for the
engine-side spill queue waits while the copies queued there already fill
``capacity_bytes``, but never past the submit's deadline nor, once the journal has been
failing for ``block_timeout_s``, at all: a full disk must not stall the engine once per
record.  Every wait is counted (``submit_waits``, the ``blocked_submits`` gauge).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from fd_routing_replay.writer.metrics import WriterMetrics
from fd_routing_replay.writer.ring import Block, RingAllocator
from fd_routing_replay.writer.spill import SpillQueue

__all__ = ["Backpressure"]


class Backpressure:
    """The waits of one writer's submits; used with the writer's lock (``cond``) held.

    ``closed()`` says the writer is closing: every wait ends at once.
    """

    def __init__(self, *, cond: threading.Condition, ring: RingAllocator, spill: SpillQueue,
                 metrics: WriterMetrics, block_timeout_s: float, journal_dir: Path,
                 closed: Callable[[], bool]) -> None:
        self._cond = cond
        self._ring = ring
        self._spill = spill
        self._metrics = metrics
        self._block_timeout_s = block_timeout_s
        self._journal_dir = journal_dir
        self._closed = closed
        self.blocked = 0
        """Submits waiting now."""

    def wait_for_room(self, nbytes: int, deadline: float) -> Block | None:
        """full_policy=block: wait until ``deadline`` for ring space (lock held)."""
        self.blocked += 1
        self._metrics.inc("submit_waits")
        try:
            while True:
                if not self._spill:
                    block = self._ring.alloc(nbytes)
                    if block is not None:
                        return block
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed():
                    return None
                self._cond.wait(remaining)
        finally:
            self.blocked -= 1

    def wait_for_spill_memory(self, nbytes: int, deadline: float) -> str | None:
        """Wait (lock held) until copies waiting for the journal leave room for ``nbytes``
        (at most ``capacity_bytes`` of them); None when there is room, else why not.

        Never past ``deadline`` (``block_timeout_s`` after the submit began), and not at
        all once the journal has been failing for ``block_timeout_s``: a full disk must
        not stall the engine once per record.
        """
        if self._spill.has_room(nbytes):
            return None
        timeout = self._block_timeout_s
        self.blocked += 1
        self._metrics.inc("submit_waits")
        try:
            while not self._spill.has_room(nbytes):
                now = time.monotonic()
                limit = deadline
                if self._spill.failing_since is not None:
                    limit = min(limit, self._spill.failing_since + timeout)
                if now >= limit or self._closed():
                    break
                self._cond.wait(min(limit - now, 1.0))
            else:
                return None
        finally:
            self.blocked -= 1
        why = f"the journal {self._journal_dir} "
        if self._spill.error is not None and self._spill.failing_since is not None:
            why += f"cannot be written ({self._spill.error})"
        else:
            why += f"did not keep up within writer.block_timeout_s={timeout:g}s"
        return (f"the writer's memory is full ({self._ring.used_bytes} bytes in the ring, "
                f"{self._spill.bytes} bytes waiting for the journal) and {why}")
