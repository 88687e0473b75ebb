"""The engine side's memory of every operation the writer has not finished yet.

Each submitted :class:`~fd_routing_replay.writer.operation.Operation` is *sent* (its
message went to the writer; for a put its ids sit in a ring range), *spilling* (the
engine side is writing it to the journal) or in the *journal* (its ring range is free;
the writer replays it from disk): its ``OperationState``.  Results from the
writer move operations along and update the metrics; a restart re-sends exactly the
*sent* ones.  Not thread-safe: the writer calls it with its lock held, and publishes the
metrics it collected after releasing the lock.
"""

from __future__ import annotations

import logging
from typing import Any

from fd_routing_replay.writer.durable import DurableTurns
from fd_routing_replay.writer.metrics import WriterMetrics
from fd_routing_replay.writer.operation import Operation, OperationKind, OperationState
from fd_routing_replay.writer.ring import RingAllocator

__all__ = ["Ledger"]


class Ledger:
    """Unfinished operations by sequence number, their ring ranges and states."""

    def __init__(self, ring: RingAllocator) -> None:
        self.ring = ring
        self.ops: dict[int, Operation] = {}
        self.counts: dict[str, int] = {}  # metric increments not yet applied
        self.put_latencies: list[float] = []
        self.store_calls: dict[str, Any] | None = None
        self.logs: list[tuple[int, str, str]] = []
        self.journal_count = 0
        self._expected_journal: set[int] = set()
        # the latest stored turn of each rollout, for prefix omission
        self.durable = DurableTurns()

    def __len__(self) -> int:
        return len(self.ops)

    def add(self, op: Operation) -> None:
        self.ops[op.seq] = op
        if op.state == OperationState.JOURNAL:
            self.journal_count += 1

    def get(self, seq: int) -> Operation | None:
        return self.ops.get(seq)

    def set_state(self, op: Operation, state: OperationState) -> None:
        if op.state != OperationState.JOURNAL and state == OperationState.JOURNAL:
            self.journal_count += 1
        elif op.state == OperationState.JOURNAL and state != OperationState.JOURNAL:
            self.journal_count -= 1
        op.state = state

    def finish(self, seq: int) -> Operation | None:
        """Forget ``seq`` (done); frees its ring range."""
        op = self.ops.pop(seq, None)
        if op is not None:
            if op.block is not None:
                self.ring.free(op.block)
                op.block = None
            if op.state == OperationState.JOURNAL:
                self.journal_count -= 1
        return op

    def in_order(self, state: OperationState | None = None) -> list[Operation]:
        ops = sorted(self.ops.values(), key=lambda o: o.seq)
        return ops if state is None else [op for op in ops if op.state == state]

    def begin_restart(self) -> list[Operation]:
        """The operations to re-send to a new writer generation, in submission order.

        Operations already in the journal are remembered: if the new writer does not find
        them on disk, the old one finished them just before it died.
        """
        self._expected_journal = {op.seq for op in self.ops.values()
                                  if op.state == OperationState.JOURNAL}
        return self.in_order(OperationState.SENT)

    def apply(self, msg: list[Any]) -> bool:
        """Apply one result from the writer; True when it is the ``started`` message.

        Metric increments and log records are collected, not emitted: the writer hands
        them to :meth:`publish` after releasing its lock.
        """
        kind = msg[0]
        if kind == "done":
            op = self.finish(msg[1])
            if len(msg) > 2:
                self._written(msg[2], msg[3])
                if op is not None:
                    self.durable.stored(op)
            if op is not None:
                self.durable.finished(op)  # forget what a delete or retirement removed
            if op is not None and op.kind in (OperationKind.DELETE, OperationKind.DELETE_PREFIX):
                self._count("deleted")
        elif kind == "w":      # stored; "done" follows its only_last_turn retirement
            self._written(msg[2], msg[3])
            op = self.ops.get(msg[1])
            if op is not None:
                self.durable.stored(op, retiring=True)
        elif kind == "spilled":
            self._count("spilled")
            op = self.ops.get(msg[1])
            if op is not None:
                if op.block is not None:
                    self.ring.free(op.block)
                    op.block = None
                self.set_state(op, OperationState.JOURNAL)
        elif kind == "dead":
            self._count("dead_lettered")
        elif kind == "superseded":
            self._count("superseded")
            op = self.ops.get(msg[1])
            if op is not None:
                self.durable.superseded(op)
        elif kind == "incomplete":
            self._count("records_incomplete", msg[1])
        elif kind == "errs":
            self._count("retries", msg[1])
            self._count("store_errors", msg[2])
        elif kind == "store":
            self.store_calls = msg[1]
        elif kind == "log":
            self.logs.append((msg[1], msg[2], msg[3]))
        elif kind == "started":
            self._started(msg[2])
            return True
        return False

    def publish(self, metrics: WriterMetrics) -> None:
        """Apply the collected metric increments and emit the collected log records."""
        counts, latencies, logs = self.counts, self.put_latencies, self.logs
        self.counts, self.put_latencies, self.logs = {}, [], []
        store_calls, self.store_calls = self.store_calls, None
        metrics.add(counts, latencies)
        if store_calls is not None:
            metrics.set_store_calls(store_calls)
        for level, name, text in logs:
            logging.getLogger(name).log(level, "%s", text)

    def _count(self, name: str, amount: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount

    def _written(self, nbytes: int, seconds: float) -> None:
        self._count("written")
        self._count("written_bytes", nbytes)
        self.put_latencies.append(seconds)

    def _started(self, found: list[list[Any]]) -> None:
        on_disk = {seq for seq, _sub, _label in found}
        for seq in self._expected_journal - on_disk:
            op = self.ops.get(seq)
            if op is not None and op.state == OperationState.JOURNAL:
                self.finish(seq)
                self.durable.finished(op)  # applied: forget what it deleted
        self._expected_journal = set()
        for seq, _sub, label in found:
            if seq not in self.ops:  # left by an earlier writer: flush() waits for it too
                self.add(Operation(OperationKind.REPLAY, seq, key=label,
                                   state=OperationState.JOURNAL))

