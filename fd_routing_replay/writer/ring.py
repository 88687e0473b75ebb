"""The engine side's one bounded queue: the ring, the operations in flight, and what it cannot take.

* :class:`RingMemory` / :class:`RingAllocator`: ``writer.capacity_bytes`` of memory (a memfd
  shared with the writer process, or plain memory in thread and inline modes) where a put's
  ids wait for the store -- an engine gathers a finished request's rows straight into it --
  allocated in order, freed as the writer acknowledges;
* :class:`Ledger`: every submitted operation until the writer finished it, *sent* (its ids in
  a ring range), *spilling* or in the *journal*; results from the writer move operations along
  and a restart re-sends exactly the *sent* ones;
* ``full_policy``: what a submit does when the ring is full.  ``spill`` journals the record
  from a copy on a thread of its own (:class:`SpillQueue`, in submission order; operations
  submitted while it is not empty queue behind it), ``block`` waits up to ``block_timeout_s``
  for ring space (:class:`Backpressure`) then spills, ``drop`` drops (counted, one log line per
  key).  The copies waiting for the journal are bounded by ``capacity_bytes`` too, so the
  writer holds at most twice that in memory; past ``block_timeout_s`` (the journal cannot keep
  up either: store down and disk full) a record is dropped, counted and logged by key.

Used with the writer's lock held (the :class:`~fd_routing_replay.writer.client.RoutingWriter`'s
condition).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fd_routing_replay.codec import encode_record_parts
from fd_routing_replay.core.logs import RateLimitedLog
from fd_routing_replay.writer.journal import DeadLetters, Journal, entry_name
from fd_routing_replay.writer.metrics import WriterMetrics
from fd_routing_replay.writer.operation import Operation, OperationKind, OperationState, pack
from fd_routing_replay.writer.record import DurableTurns
from fd_routing_replay.writer.retry import ExponentialBackoff

__all__ = ["Backpressure", "Block", "Ledger", "RingAllocator", "RingMemory", "SpillQueue"]


log = logging.getLogger("fd_routing_replay.writer")


ALIGNMENT = 64
"""Every range starts at a multiple of this (cache line; any ids dtype is aligned)."""


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def _align(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


@dataclass(eq=False)
class Block:
    """One allocated range ``[offset, offset + size)``; ``nbytes`` is what the caller asked."""

    offset: int
    size: int
    nbytes: int
    freed: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.size


class RingAllocator:
    """FIFO range allocator over ``capacity`` bytes; not thread-safe (the writer locks)."""

    def __init__(self, capacity: int) -> None:
        if capacity < ALIGNMENT:
            raise ValueError(f"ring capacity must be at least {ALIGNMENT} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGNMENT
        self._blocks: deque[Block] = deque()
        self.used_bytes = 0
        """Bytes callers asked for in live blocks (the queue-bytes gauge)."""

    def fits_ever(self, nbytes: int) -> bool:
        """True when a request of ``nbytes`` can be satisfied once the ring is empty."""
        return _align(nbytes) <= self.capacity

    def alloc(self, nbytes: int) -> Block | None:
        """A free aligned range of at least ``nbytes``, or None when there is none now."""
        size = _align(nbytes)
        if size > self.capacity:
            return None
        if not self._blocks:
            offset = 0
        else:
            tail = self._blocks[0].offset
            head = self._blocks[-1].end
            if head > tail:  # live data is [tail, head): room at the end, then at the start
                if size <= self.capacity - head:
                    offset = head
                elif size <= tail:
                    offset = 0
                else:
                    return None
            elif size <= tail - head:  # wrapped: room only between head and tail
                offset = head
            else:
                return None
        block = Block(offset, size, nbytes)
        self._blocks.append(block)
        self.used_bytes += nbytes
        return block

    def free(self, block: Block) -> None:
        """Return ``block``; its space is reusable once every older block is free too."""
        if block.freed:
            return
        block.freed = True
        self.used_bytes -= block.nbytes
        while self._blocks and self._blocks[0].freed:
            self._blocks.popleft()


class RingMemory:
    """The buffer behind the ring as a uint8 array (``array``): a memfd another process maps
    through :attr:`fd` (``shared``), or process memory (thread and inline modes)."""

    def __init__(self, capacity: int, *, shared: bool, fd: int | None = None) -> None:
        self.capacity = capacity
        self.fd = fd if fd is not None else _anonymous_shared_fd(capacity) if shared else None
        self.prefault_thread: threading.Thread | None = None
        self._mmap = None if self.fd is None else mmap.mmap(self.fd, capacity)
        self.array = np.empty(capacity, np.uint8) if self._mmap is None else np.frombuffer(self._mmap, np.uint8)

    @classmethod
    def attach(cls, fd: int, capacity: int) -> RingMemory:
        """Map a ring another process created (the writer process side)."""
        return cls(capacity, shared=True, fd=fd)

    def view(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """``nbytes`` at ``offset`` as an array of ``dtype`` and ``shape`` (no copy)."""
        return self.array[offset:offset + nbytes].view(dtype).reshape(shape)

    def prefault_in_background(self) -> threading.Thread | None:
        """Touch every page in a daemon thread with the GIL released (Linux ≥ 5.14).

        Without it the first pass around a fresh ring pays a page fault per 4 KiB on the
        engine's thread (about 1 ms per MB on a VM).  Costs ``capacity`` bytes of RAM up
        front, which the ring would reach after one lap anyway.
        """
        if not sys.platform.startswith("linux") or self.capacity == 0:
            return None
        available = _mem_available()
        if available is not None and self.capacity > available // 2:
            log.info("ring of %d bytes not pre-faulted: only %d bytes of memory available",
                     self.capacity, available)
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return None
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        address = self.array.ctypes.data
        page = mmap.PAGESIZE
        start = address - address % page
        length = self.capacity + (address - start)

        def run() -> None:
            # ctypes drops the GIL for the call; errors (old kernel) just skip it.
            if madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                log.debug("ring prefault skipped: madvise errno %d", ctypes.get_errno())

        thread = threading.Thread(target=run, name="fd-rr-ring-prefault", daemon=True)
        thread.start()
        self.prefault_thread = thread
        return thread

    def close(self) -> None:
        """Unmap and close; views still alive keep the mapping until they are dropped."""
        self.array = np.empty(0, dtype=np.uint8)
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a view is still exported; the GC unmaps it
                self._mmap.close()
            self._mmap = None
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _anonymous_shared_fd(capacity: int) -> int:
    """A file descriptor of ``capacity`` bytes of shareable memory with no name to leak (a
    memfd: Linux, as FastDeploy)."""
    fd = os.memfd_create("fd-routing-replay-ring", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
    except OSError:
        os.close(fd)
        raise
    return fd


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


class SpillQueue:
    """Operations waiting for the engine side to journal them, oldest first (``send`` hands
    a control message to the current writer generation)."""

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
        parts = list(encode_record_parts(op.record(ids))) if op.kind == OperationKind.PUT else None
        self._journal.write(entry_name(op.seq), op.sidecar(reason), parts)

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


class Backpressure:
    """The waits of one writer's submits (``closed()``: the writer is closing, every wait
    ends at once)."""

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
