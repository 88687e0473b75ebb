"""The engine side's spill: operations the ring cannot take go to the journal instead.

Under ``full_policy`` ``spill`` (or ``block`` past its wait), a record is copied and
queued here; a thread of its own journals the queue in submission order, so the caller
never writes the disk, and tells the writer about each entry (``["journal", seq, 0]``),
which replays it from disk.  Operations submitted while the queue is not empty queue
behind it, so order is kept.  A journal that refuses writes is retried with a backoff
while the copies stay in memory (bounded by the caller: :meth:`SpillQueue.has_room`); an
operation that can never be journaled (it cannot be encoded) is filed as a dead letter so
it never blocks the ones behind it.  At close, :meth:`SpillQueue.journal_leftovers`
journals whatever the writer never acknowledged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from fd_routing_replay.codec import encode_record_parts
from fd_routing_replay.writer.journal import DeadLetters, Journal, entry_name
from fd_routing_replay.writer.ledger import Ledger
from fd_routing_replay.writer.logs import RateLimitedLog
from fd_routing_replay.writer.metrics import WriterMetrics
from fd_routing_replay.writer.operation import Operation, OperationKind, OperationState
from fd_routing_replay.writer.retry import ExponentialBackoff
from fd_routing_replay.writer.ring import RingMemory
from fd_routing_replay.writer.transport import pack

__all__ = ["SpillQueue"]

log = logging.getLogger("fd_routing_replay.writer")


class SpillQueue:
    """Operations waiting for the engine side to journal them, oldest first.

    Shares the writer's lock (``cond``): :meth:`enqueue` and the attributes are used with
    it held.  ``send`` hands a control message to the current writer generation.
    """

    def __init__(self, *, cond: threading.Condition, ledger: Ledger, journal: Journal,
                 dead: DeadLetters, metrics: WriterMetrics, capacity: int,
                 closing: threading.Event, send: Callable[[bytes], None]) -> None:
        self._cond = cond
        self._ledger = ledger
        self._journal = journal
        self._dead = dead
        self._metrics = metrics
        self._capacity = capacity
        self._closing = closing
        self._send = send
        self.items: deque[Operation] = deque()
        self.bytes = 0
        """Bytes of the ids copies in :attr:`items` (at most about ``capacity``)."""
        self.failing_since: float | None = None
        """When the journal began refusing this thread's writes (None while it takes them)."""
        self.error: BaseException | None = None
        self._error_log = RateLimitedLog(log)
        self._backoff = ExponentialBackoff(0.1, 1.0, jitter=0.0)  # journal refused: retry
        self._thread: threading.Thread | None = None
        self._taken_over = False

    def __bool__(self) -> bool:
        return bool(self.items)

    def has_room(self, nbytes: int) -> bool:
        """True when a copy of ``nbytes`` may join the queue (one always may when empty)."""
        return not self.bytes or self.bytes + nbytes <= self._capacity

    def enqueue(self, op: Operation) -> None:
        """Queue ``op`` (lock held) and make sure the spill thread runs."""
        op.state = OperationState.SPILLING
        self._ledger.add(op)
        self.items.append(op)
        self.bytes += op.nbytes if op.ids is not None else 0
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="fd-rr-writer-spill",
                                            daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def write(self, op: Operation, reason: str, ids: np.ndarray | None = None) -> None:
        """Journal ``op`` (a put's record encoded from ``ids`` or its own copy)."""
        name = entry_name(op.seq)
        if op.kind == OperationKind.PUT:
            parts = list(encode_record_parts(op.record(ids)))
            self._journal.write(name, op.sidecar(reason), parts)
        else:
            self._journal.write(name, op.sidecar(reason))

    def dead_letter(self, op: Operation, exc: BaseException, ids: np.ndarray | None) -> None:
        """File an operation that cannot be journaled for a reason other than the disk (it
        cannot be encoded), so it never blocks the operations behind it.  Keeps the record
        when it can be encoded; counted in ``dead_lettered``."""
        reason = f"writer could not journal {op.kind} of {op.label}"
        parts = None
        if op.kind == OperationKind.PUT:
            try:
                parts = list(encode_record_parts(op.record(ids)))
            except Exception:  # noqa: BLE001 - the sidecar is still worth keeping
                parts = None
        try:
            path = self._dead.add(entry_name(op.seq), op.sidecar(reason), reason, error=exc,
                                  parts=parts)
            log.error("routing writer: %s (rollout %s): %s: %s; kept as dead letter %s%s",
                      reason, op.rollout_id or "-", type(exc).__name__, exc, path,
                      "" if parts is not None or op.kind != OperationKind.PUT
                      else " (without its ids)")
        except OSError as write_error:
            log.error("routing writer: LOST %s (rollout %s): %s: %s; and the dead letter "
                      "could not be written to %s: %s", op.label, op.rollout_id or "-",
                      type(exc).__name__, exc, self._dead.directory, write_error)
        self._metrics.inc("dead_lettered")

    def _loop(self) -> None:
        """Journal the queue in order; never dies on one bad operation."""
        failures = 0
        while True:
            with self._cond:
                while not self.items and not self._closing.is_set():
                    self._cond.wait(1.0)
                if not self.items or self._taken_over:
                    return
                op = self.items[0]
            reason = f"writer full (capacity {self._capacity} bytes)"
            try:
                self.write(op, reason)
            except OSError as exc:
                failures += 1
                with self._cond:
                    if self.failing_since is None:
                        self.failing_since = time.monotonic()
                    self.error = exc
                    self._cond.notify_all()  # waiting submits re-check their limit
                self._error_log.log(logging.ERROR, "spill",
                                    "routing writer: cannot write %s to the journal %s: %s; "
                                    "holding it in memory and retrying", op.label,
                                    self._journal.directory, exc)
                if self._closing.wait(self._backoff.compute(failures)):
                    return
                continue
            except Exception as exc:  # noqa: BLE001 - this one can never be journaled
                self.dead_letter(op, exc, None)
                with self._cond:
                    if self.items and self.items[0] is op:
                        self.items.popleft()
                        self.bytes -= op.nbytes if op.ids is not None else 0
                        self._ledger.finish(op.seq)
                        self._cond.notify_all()
                continue
            if failures:
                suppressed = self._error_log.reset("spill")
                log.warning("routing writer: the journal %s takes writes again (%d failed "
                            "attempts, %d log lines suppressed)", self._journal.directory,
                            failures, suppressed)
            failures = 0
            with self._cond:
                self.failing_since = None
                self.error = None
                if not self.items or self.items[0] is not op:
                    return  # close() took over the queue meanwhile
                self.items.popleft()
                self.bytes -= op.nbytes if op.ids is not None else 0
                op.ids = None
                if self._ledger.get(op.seq) is not None:
                    self._ledger.set_state(op, OperationState.JOURNAL)
                self._send(pack(["journal", op.seq, 0]))
                self._cond.notify_all()
            self._metrics.inc("spilled")

    def journal_leftovers(self, ring_memory: RingMemory) -> None:
        """At close: journal what the writer never acknowledged (it was killed or hung) and
        what still waited in the queue; each one that cannot be journaled is logged as
        LOST and counted in ``dropped``, and never stops the others."""
        with self._cond:
            leftovers = [(op, True, "writer stopped before the store acknowledged")
                         for op in self._ledger.in_order(OperationState.SENT)]
            leftovers += [(op, self._ledger.get(op.seq) is not None, "writer full at close")
                          for op in self.items]
            self.items.clear()
            self.bytes = 0
            self._taken_over = True
        for op, tracked, reason in leftovers:
            try:
                ids = None
                if op.kind == OperationKind.PUT and op.ids is None:
                    ids = ring_memory.view(op.offset, op.nbytes, np.dtype(op.dtype),
                                           tuple(op.shape))
                self.write(op, reason, ids)
            except OSError as exc:
                self._metrics.inc("dropped")
                log.error("routing writer: LOST %s (rollout %s) at close: it could not be "
                          "journaled in %s: %s", op.label, op.rollout_id or "-",
                          self._journal.directory, exc)
                self._ledger.finish(op.seq)
                continue
            except Exception as exc:  # noqa: BLE001 - cannot be encoded: file it, go on
                self.dead_letter(op, exc, ids)
                self._ledger.finish(op.seq)
                continue
            if tracked:
                self._ledger.set_state(op, OperationState.JOURNAL)
