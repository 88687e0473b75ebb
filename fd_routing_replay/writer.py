"""Background writer: records reach the store without touching the engine's step time.

The engine calls :meth:`RoutingWriter.submit_put` when a request finishes.  On the
caller's thread that costs validation, one copy of the ids into a shared-memory ring
and a short control message — no encoding, checksum, store I/O or retry.  A writer
process (or thread, ``writer.mode: thread``) does the rest; see
:mod:`fd_routing_replay.writing.worker` for ordering, retries, the journal and the
retirement of turns under ``only_last_turn`` (:mod:`fd_routing_replay.writing.turns`).

Guarantees (docs/operations.md has the operator's view):

* operations on one key apply in submission order;
* capacity is counted in bytes; when full, ``full_policy`` applies: ``spill`` (journal
  the record, replay later), ``block`` (wait up to ``block_timeout_s``, then spill) or
  ``drop`` (counted, one log line per key) — nothing disappears without both;
* a submit never waits longer than ``block_timeout_s``: when the journal cannot keep up
  either (store down and disk full), the record is dropped, counted and logged by key;
* every record is checked on the caller's thread (:meth:`Operation.for_put
  <fd_routing_replay.writing.operation.Operation.for_put>`, the rr-v1 header size
  included), so nothing the writer accepts can fail to encode later;
* if the writer process dies (even SIGKILL) it is restarted and every operation it had
  not acknowledged is sent again; journal entries are replayed at start;
* nothing is cleared at start unless ``clear_on_start`` is set;
* :meth:`close` (also run at interpreter exit) flushes with a timeout, spills what is
  left and logs it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from fd_routing_replay.codec import ENCODINGS, RoutingRecord, encode_record_parts
from fd_routing_replay.config import (
    RoutingReplayConfig,
    StoreConfig,
    WriterConfig,
    config_from_dict,
    config_to_dict,
)
from fd_routing_replay.errors import (
    ConfigError,
    InvalidRolloutId,
    RecordError,
    RoutingReplayError,
)
from fd_routing_replay.keys import check_key, check_prefix, parse_rollout_id
from fd_routing_replay.metrics import labels_for, rank_label, render_capture
from fd_routing_replay.store import store_config_from
from fd_routing_replay.store.registry import resolve_factory, store_type_of
from fd_routing_replay.writing.directories import RankIdentity, resolve_writer_directories
from fd_routing_replay.writing.journal import DeadLetters, DirectoryLock, Journal, entry_name
from fd_routing_replay.writing.ledger import JOURNAL, SENT, SPILLING, Ledger, Pending
from fd_routing_replay.writing.logs import RateLimitedLog
from fd_routing_replay.writing.metrics import WriterMetrics
from fd_routing_replay.writing.operation import Operation
from fd_routing_replay.writing.prefix import TurnPrefix, prefix_for
from fd_routing_replay.writing.ring import Block, RingAllocator, RingMemory
from fd_routing_replay.writing.sweeper import Sweeper
from fd_routing_replay.writing.transport import (
    ProcessLink,
    ThreadLink,
    pack,
    portable_store_registrations,
    unpack,
)
from fd_routing_replay.writing.validation import as_list
from fd_routing_replay.writing.worker import Worker, WorkerSettings

__all__ = ["RECORD_FORMATS", "RoutingWriter"]

log = logging.getLogger("fd_routing_replay.writer")

RECORD_FORMATS = ("rr-v1", "fastdeploy-raw")
_LOCK_WAIT_S = 10.0
_RECV_WAIT_S = 0.25
_RESULTS_PER_LOCK = 32
_MAX_RESTART_DELAY_S = 5.0
_LEFTOVER_KEYS_SHOWN = 20
_live_writers: weakref.WeakSet[RoutingWriter] = weakref.WeakSet()


class RoutingWriter:
    """Puts and deletes routing records in the background; see the module docstring.

    ``store_config`` is a ``StoreConfig`` (or anything ``open_store`` accepts: a URL, a
    type name, a dict, a full config); ``writer_config`` a ``WriterConfig`` or a dict of
    its keys.  ``record_format`` is ``rr-v1`` or ``fastdeploy-raw`` (raw padded bytes,
    for trainers that read FastDeploy's layout); ``encoding`` the rr-v1 payload encoding
    (``plain`` or ``set``, applied in the writer process).  ``identity`` says which rank this writer
    serves; it picks (or fills the placeholders of) the journal and dead-letter
    directories, so writers of different ranks never share one (see
    :mod:`fd_routing_replay.writing.directories`; unset fields come from the environment).
    ``retention`` (a ``RetentionConfig``) with ``ttl_s`` or ``max_bytes`` set makes the
    writer of rank dp0-tp0 sweep the namespace (:mod:`fd_routing_replay.retention`); a
    store that expires records itself (Redis) gets ``ttl_s`` at write time.
    Thread-safe.
    """

    def __init__(self, store_config: Any, writer_config: WriterConfig | dict | None = None,
                 *, only_last_turn: bool = False, record_format: str = "rr-v1",
                 identity: RankIdentity | None = None, encoding: str = "plain",
                 retention: Any = None) -> None:
        self._store_config: StoreConfig = store_config_from(store_config)
        resolve_factory(store_type_of(self._store_config))  # unknown backend: fail now
        if writer_config is None or isinstance(writer_config, dict):
            writer_config = config_from_dict({"writer": writer_config or {}},
                                             source="RoutingWriter(writer_config=...)").writer
        if not isinstance(writer_config, WriterConfig):
            raise TypeError(f"writer_config must be a WriterConfig or a dict, got "
                            f"{type(writer_config).__name__}")
        if record_format not in RECORD_FORMATS:
            raise ConfigError(f"capture.record_format: invalid value {record_format!r}; "
                              f"allowed: {', '.join(RECORD_FORMATS)}")
        self.config = writer_config
        self.only_last_turn = bool(only_last_turn)
        if encoding not in ENCODINGS or (encoding != "plain" and record_format != "rr-v1"):
            raise ConfigError(f"capture.encoding: invalid value {encoding!r} with record_format "
                              f"{record_format!r}; allowed: {', '.join(ENCODINGS)} (rr-v1 only)")
        self.record_format = record_format
        self.encoding = encoding  # applied by the worker (writer process), not here
        # retention.ttl_s: a store that can expire records itself does so at write time.
        self.record_ttl_s = float(getattr(retention, "ttl_s", 0.0) or 0.0)
        self.mode = writer_config.mode
        directories = resolve_writer_directories(self._store_config, writer_config, identity)
        self._journal = Journal(directories.journal)
        self._dead = DeadLetters(directories.dead_letter)
        log.info("routing writer: journal %s, dead letters %s", self._journal.directory,
                 self._dead.directory)
        self._dir_lock = DirectoryLock(self._journal.directory)
        self._dir_lock.acquire(_LOCK_WAIT_S)
        self._journal.remove_debris()
        self._next_seq = max(time.time_ns() // 1000, self._journal.max_seq() + 1)
        self._metrics = WriterMetrics(labels_for(
            self._store_config.namespace, store_type_of(self._store_config),
            rank_label((identity or RankIdentity()).resolved())))
        self._ring_memory = RingMemory(writer_config.capacity_bytes,
                                       shared=self.mode == "process")
        self._ring_memory.prefault_in_background()
        self._ring = RingAllocator(writer_config.capacity_bytes)
        self._cond = threading.Condition(threading.Lock())
        self._ledger = Ledger(self._ring)
        self._blocked = 0
        self._spill_items: deque[Operation] = deque()
        self._spill_bytes = 0
        self._journal_failing_since: float | None = None  # the spill thread's writes fail
        self._journal_error: BaseException | None = None
        self._error_log = RateLimitedLog(log)
        self._spill_thread: threading.Thread | None = None
        self._spill_taken_over = False
        self._closed = False
        self._closing = threading.Event()
        self._started = threading.Event()
        self._link_exited = threading.Event()
        self._generation = 0
        self._link: ProcessLink | ThreadLink | None = None
        self._server = None
        for name, source in (
                ("queue_bytes", lambda: self._ring.used_bytes + self._spill_bytes),
                ("pending_ops", lambda: len(self._ledger.ops)),
                ("journal_entries", lambda: self._ledger.journal_count),
                ("blocked_submits", lambda: self._blocked)):
            self._metrics.bind_gauge(name, source)
        try:
            if writer_config.metrics_port:
                try:
                    self._server = self._metrics.serve(writer_config.metrics_port,
                                                       writer_config.metrics_addr)
                except OSError as exc:
                    raise ConfigError(f"writer.metrics_port: cannot serve metrics on "
                                      f"{writer_config.metrics_addr} port "
                                      f"{writer_config.metrics_port}: {exc}") from exc
            self._start_generation(initial=True)
        except BaseException:
            self._release_resources()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="fd-rr-writer-recv",
                                          daemon=True)
        self._receiver.start()
        self._sweeper = Sweeper.start_for(self._store_config, retention,
                                          (identity or RankIdentity()).resolved())
        _live_writers.add(self)

    @classmethod
    def from_config(cls, config: RoutingReplayConfig, *,
                    identity: RankIdentity | None = None) -> RoutingWriter:
        """A writer for a whole configuration (store, writer, retention, capture format)."""
        return cls(config.store, config.writer, only_last_turn=config.retention.only_last_turn,
                   record_format=config.capture.record_format, identity=identity,
                   encoding=config.capture.encoding, retention=config.retention)

    # -- submit -------------------------------------------------------------------------
    def submit_put(self, key: str, record: RoutingRecord, *, final: bool | None = None,
                   prefix: TurnPrefix | None = None) -> bool:
        """Queue ``record`` for the store under ``key``; returns False only when dropped.

        ``key`` is the record's rollout id (fused) or ``{rollout_id}_{layer}``.  ``final``
        marks the put that completes the rollout's turn for ``only_last_turn``; by default
        True for a fused key and, for a per-layer key, True when ``record.metadata
        ["num_layers"]`` says this is the last layer.  Bad records and keys (a header over
        the rr-v1 limit included) raise ``RecordError`` / ``InvalidRolloutId`` and leave
        the writer untouched.  Waits at most ``writer.block_timeout_s`` (``full_policy``
        ``block``, or a journal that cannot keep up); past that the record is dropped,
        counted and logged by key.

        ``prefix`` (from :meth:`durable_prefix`) says ``record`` holds only the positions
        after that stored previous turn: the writer prepends its rows before storing
        (:mod:`fd_routing_replay.writing.prefix`).
        """
        start = time.perf_counter()
        self._check_open()
        try:
            op = Operation.for_put(key, record, final=final, fmt=self.record_format, prefix=prefix)
        except (RecordError, InvalidRolloutId):
            self._metrics.inc("rejected")
            raise
        ids = record.ids
        nbytes = ids.nbytes
        policy = self.config.full_policy
        deadline = time.monotonic() + self.config.block_timeout_s
        dropped: str | None = None
        with self._cond:
            block = None
            if not self._spill_items:
                block = self._ring.alloc(nbytes)
                if block is None and policy == "block" and self._ring.fits_ever(nbytes):
                    block = self._wait_for_room(nbytes, deadline)
            if block is not None:
                op.seq = self._take_seq()
                op.offset = block.offset
                np.copyto(self._ring_memory.view(block.offset, nbytes, ids.dtype, ids.shape), ids)
                message = pack(["op", op.to_wire()])
                self._ledger.add(Pending(op.seq, "put", key, message, block, operation=op))
                self._link.send(message)
            elif policy == "drop":
                self._metrics.inc("dropped")
                dropped = (f"routing writer full ({self._ring.used_bytes} of "
                           f"{self._ring.capacity} bytes queued): dropped record {key} "
                           f"({nbytes} bytes) under writer.full_policy=drop")
            else:
                problem = self._wait_for_spill_memory(nbytes, deadline)
                if problem is None:
                    op.seq = self._take_seq()
                    op.ids = np.array(ids, copy=True)
                    self._enqueue_spill(op)
                else:
                    self._metrics.inc("dropped")
                    self._metrics.inc("dropped_journal_full")
                    dropped = (f"routing writer: dropped record {key} (rollout {op.rollout_id}, "
                               f"{nbytes} bytes): {problem}")
        self._metrics.inc("submitted")
        if dropped is not None:
            if policy == "drop":
                log.warning("%s", dropped)
            else:
                log.error("%s", dropped)
            return False
        self._metrics.observe_submit(time.perf_counter() - start)
        return True

    def submit_delete(self, keys: Iterable[str] | str) -> None:
        """Queue the deletion of exact store keys (ordered after earlier puts to them)."""
        self._check_open()
        try:
            targets = [check_key(k) for k in as_list(keys, "keys")]
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        self._submit_delete("delete", targets)

    def submit_delete_prefix(self, prefixes: Iterable[str] | str) -> None:
        """Queue boundary-safe prefix deletes (``exp:1`` never touches ``exp:10``)."""
        self._check_open()
        try:
            targets = [check_prefix(p) for p in as_list(prefixes, "prefixes")]
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        self._submit_delete("delete_prefix", targets)

    def submit_retire(self, rollout_id: str, layer_count: int = 0) -> None:
        """Queue the ``only_last_turn`` retirement of a turn that is already stored:
        delete turn t-1's keys, and turn t's own when a later turn is stored
        (:mod:`fd_routing_replay.writing.turns`).  The writer does this by itself after
        every final put; this is for replaying a retirement that was dead-lettered.
        ``layer_count`` is how many per-layer keys ``{rollout_id}_{n}`` to consider."""
        self._check_open()
        try:
            parse_rollout_id(rollout_id)
        except InvalidRolloutId:
            self._metrics.inc("rejected")
            raise
        if isinstance(layer_count, bool) or not isinstance(layer_count, int) or layer_count < 0:
            self._metrics.inc("rejected")
            raise RecordError(f"layer_count must be a non-negative int, got {layer_count!r}")
        self._submit_op(Operation("retire", rollout_id=rollout_id, layer_count=layer_count))

    def _submit_delete(self, kind: str, targets: list[str]) -> None:
        if not targets:
            return
        self._submit_op(Operation.for_delete(kind, targets))

    def _submit_op(self, op: Operation) -> None:
        """Queue a delete, prefix delete or retirement in submission order."""
        kind = op.kind
        with self._cond:
            op.seq = self._take_seq()
            if self._spill_items:  # keep order behind records still being journaled
                self._enqueue_spill(op)
            else:
                message = pack(["op", op.to_wire()])
                self._ledger.add(Pending(op.seq, kind, op.label, message, operation=op))
                self._link.send(message)
        self._metrics.inc("submitted")

    def _check_open(self) -> None:
        if self._closed:
            raise RoutingReplayError("this RoutingWriter is closed; create a new one")

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _wait_for_room(self, nbytes: int, deadline: float) -> Block | None:
        """full_policy=block: wait until ``deadline`` for ring space (lock held)."""
        self._blocked += 1
        self._metrics.inc("submit_waits")
        try:
            while True:
                if not self._spill_items:
                    block = self._ring.alloc(nbytes)
                    if block is not None:
                        return block
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._cond.wait(remaining)
        finally:
            self._blocked -= 1

    # -- engine-side spill ----------------------------------------------------------------
    def _spill_room(self, nbytes: int) -> bool:
        return not self._spill_bytes or self._spill_bytes + nbytes <= self._ring.capacity

    def _wait_for_spill_memory(self, nbytes: int, deadline: float) -> str | None:
        """Wait (lock held) until copies waiting for the journal leave room for ``nbytes``
        (at most ``capacity_bytes`` of them); None when there is room, else why not.

        Never past ``deadline`` (``block_timeout_s`` after the submit began), and not at
        all once the journal has been failing for ``block_timeout_s``: a full disk must
        not stall the engine once per record.
        """
        if self._spill_room(nbytes):
            return None
        timeout = self.config.block_timeout_s
        self._blocked += 1
        self._metrics.inc("submit_waits")
        try:
            while not self._spill_room(nbytes):
                now = time.monotonic()
                limit = deadline
                if self._journal_failing_since is not None:
                    limit = min(limit, self._journal_failing_since + timeout)
                if now >= limit or self._closed:
                    break
                self._cond.wait(min(limit - now, 1.0))
            else:
                return None
        finally:
            self._blocked -= 1
        why = f"the journal {self._journal.directory} "
        if self._journal_error is not None and self._journal_failing_since is not None:
            why += f"cannot be written ({self._journal_error})"
        else:
            why += f"did not keep up within writer.block_timeout_s={timeout:g}s"
        return (f"the writer's memory is full ({self._ring.used_bytes} bytes in the ring, "
                f"{self._spill_bytes} bytes waiting for the journal) and {why}")

    def _enqueue_spill(self, op: Operation) -> None:
        self._ledger.add(Pending(op.seq, op.kind, op.label, state=SPILLING, operation=op))
        self._spill_items.append(op)
        self._spill_bytes += op.nbytes if op.ids is not None else 0
        if self._spill_thread is None or not self._spill_thread.is_alive():
            self._spill_thread = threading.Thread(target=self._spill_loop,
                                                  name="fd-rr-writer-spill", daemon=True)
            self._spill_thread.start()
        self._cond.notify_all()

    def _write_spill(self, op: Operation, reason: str, ids: np.ndarray | None = None) -> None:
        """Journal ``op`` (a put's record encoded from ``ids`` or its own copy)."""
        name = entry_name(op.seq)
        if op.kind == "put":
            parts = list(encode_record_parts(op.record(ids)))
            self._journal.write(name, op.sidecar(reason), parts)
        else:
            self._journal.write(name, op.sidecar(reason))

    def _dead_letter_here(self, op: Operation, exc: BaseException, ids: np.ndarray | None) -> None:
        """File an operation that cannot be journaled for a reason other than the disk (it
        cannot be encoded), so it never blocks the operations behind it.  Keeps the record
        when it can be encoded; counted in ``dead_lettered``."""
        reason = f"writer could not journal {op.kind} of {op.label}"
        parts = None
        if op.kind == "put":
            try:
                parts = list(encode_record_parts(op.record(ids)))
            except Exception:  # noqa: BLE001 - the sidecar is still worth keeping
                parts = None
        try:
            path = self._dead.add(entry_name(op.seq), op.sidecar(reason), reason, error=exc,
                                  parts=parts)
            log.error("routing writer: %s (rollout %s): %s: %s; kept as dead letter %s%s",
                      reason, op.rollout_id or "-", type(exc).__name__, exc, path,
                      "" if parts is not None or op.kind != "put" else " (without its ids)")
        except OSError as write_error:
            log.error("routing writer: LOST %s (rollout %s): %s: %s; and the dead letter "
                      "could not be written to %s: %s", op.label, op.rollout_id or "-",
                      type(exc).__name__, exc, self._dead.directory, write_error)
        self._metrics.inc("dead_lettered")

    def _spill_loop(self) -> None:
        """Journal the spill queue in order; never dies on one bad operation."""
        failures = 0
        while True:
            with self._cond:
                while not self._spill_items and not self._closing.is_set():
                    self._cond.wait(1.0)
                if not self._spill_items or self._spill_taken_over:
                    return
                op = self._spill_items[0]
            reason = f"writer full (capacity {self._ring.capacity} bytes)"
            try:
                self._write_spill(op, reason)
            except OSError as exc:
                failures += 1
                with self._cond:
                    if self._journal_failing_since is None:
                        self._journal_failing_since = time.monotonic()
                    self._journal_error = exc
                    self._cond.notify_all()  # waiting submits re-check their limit
                self._error_log.log(logging.ERROR, "spill",
                                    "routing writer: cannot write %s to the journal %s: %s; "
                                    "holding it in memory and retrying", op.label,
                                    self._journal.directory, exc)
                if self._closing.wait(min(0.05 * 2 ** min(failures, 10), 1.0)):
                    return
                continue
            except Exception as exc:  # noqa: BLE001 - this one can never be journaled
                self._dead_letter_here(op, exc, None)
                with self._cond:
                    if self._spill_items and self._spill_items[0] is op:
                        self._spill_items.popleft()
                        self._spill_bytes -= op.nbytes if op.ids is not None else 0
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
                self._journal_failing_since = None
                self._journal_error = None
                if not self._spill_items or self._spill_items[0] is not op:
                    return  # close() took over the queue meanwhile
                self._spill_items.popleft()
                self._spill_bytes -= op.nbytes if op.ids is not None else 0
                op.ids = None
                pending = self._ledger.get(op.seq)
                if pending is not None:
                    self._ledger.set_state(pending, JOURNAL)
                self._link.send(pack(["journal", op.seq, 0]))
                self._cond.notify_all()
            self._metrics.inc("spilled")

    # -- flush / close -------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted operation is in the store (or dead-lettered).

        Spilled records count as not yet written.  Returns False when ``timeout``
        (default ``writer.close_timeout_s``) passes first.
        """
        timeout = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._started.wait(timeout):
            return False
        with self._cond:
            if self._link is not None and not self._closed:
                self._link.send(pack(["nudge"]))
            while self._ledger:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
        return True

    def close(self, timeout: float | None = None) -> None:
        """Flush for up to ``timeout`` seconds, then stop; whatever is left stays in the
        journal (replayed by the next writer) and is logged.  Idempotent; the journal
        lock and the ring are released even when something fails on the way."""
        if self._closed:
            return
        timeout = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            self.flush(timeout)
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                while self._spill_items and time.monotonic() < deadline:
                    self._cond.wait(max(min(deadline - time.monotonic(), 1.0), 0.01))
                self._closing.set()
                self._cond.notify_all()
                link = self._link
            if self._spill_thread is not None:
                self._spill_thread.join(5.0)
            if link is not None:
                link.send(pack(["stop"]))
                if not self._link_exited.wait(max(deadline - time.monotonic(), 2.0)):
                    log.error("routing writer (pid %s) did not stop in time; killing it",
                              link.pid)
                    link.kill()
                    self._link_exited.wait(2.0)
            self._receiver.join(2.0)
            if link is not None:
                link.close()
            self._spill_leftovers()
            self._log_leftovers()
        finally:
            self._closed = True
            self._closing.set()
            self._release_resources()
            _live_writers.discard(self)

    def _spill_leftovers(self) -> None:
        """Journal what the writer never acknowledged (it was killed or hung) and what
        still waited for the spill thread; each one that cannot be journaled is logged as
        LOST and counted in ``dropped``, and never stops the others."""
        with self._cond:
            leftovers = [(pending, pending.operation, "writer stopped before the store "
                          "acknowledged") for pending in self._ledger.in_order(SENT)]
            leftovers += [(self._ledger.get(op.seq), op, "writer full at close")
                          for op in self._spill_items]
            self._spill_items.clear()
            self._spill_bytes = 0
            self._spill_taken_over = True
        for pending, op, reason in leftovers:
            if op is None:
                continue
            try:
                ids = None
                if op.kind == "put" and op.ids is None:
                    ids = self._ring_memory.view(op.offset, op.nbytes, np.dtype(op.dtype),
                                                 tuple(op.shape))
                self._write_spill(op, reason, ids)
            except OSError as exc:
                self._metrics.inc("dropped")
                log.error("routing writer: LOST %s (rollout %s) at close: it could not be "
                          "journaled in %s: %s", op.label, op.rollout_id or "-",
                          self._journal.directory, exc)
                self._ledger.finish(op.seq)
                continue
            except Exception as exc:  # noqa: BLE001 - cannot be encoded: file it, go on
                self._dead_letter_here(op, exc, ids)
                self._ledger.finish(op.seq)
                continue
            if pending is not None:
                self._ledger.set_state(pending, JOURNAL)

    def _log_leftovers(self) -> None:
        if not self._ledger:
            return
        labels = [op.label for op in self._ledger.in_order()]
        shown = ", ".join(labels[:_LEFTOVER_KEYS_SHOWN])
        more = f" and {len(labels) - _LEFTOVER_KEYS_SHOWN} more" if len(labels) > \
            _LEFTOVER_KEYS_SHOWN else ""
        log.warning("routing writer closed with %d operations not yet in the store; they are "
                    "in the journal %s and are replayed when a writer starts there: %s%s",
                    len(labels), self._journal.directory, shown, more)

    def _release_resources(self) -> None:
        sweeper, self._sweeper = getattr(self, "_sweeper", None), None
        if sweeper is not None:
            sweeper.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._ring_memory.close()
        self._dir_lock.release()

    def __enter__(self) -> RoutingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters, gauges and latency percentiles; the same numbers as the metrics."""
        out = self._metrics.snapshot()
        out.update(mode=self.mode, worker_pid=self.worker_pid,
                   capacity_bytes=self._ring.capacity, full_policy=self.config.full_policy,
                   journal_dir=str(self._journal.directory),
                   dead_letter_dir=str(self._dead.directory))
        return out

    def ready(self, timeout: float | None = None) -> bool:
        """Wait until the writer has started and the ring's pages are pre-faulted.

        Optional: submits work before that, the first lap around the ring just pays page
        faults.  Call it at engine start-up before latency-sensitive work.
        """
        deadline = time.monotonic() + (self.config.close_timeout_s if timeout is None else timeout)
        if not self._started.wait(max(deadline - time.monotonic(), 0)):
            return False
        thread = self._ring_memory.prefault_thread
        if thread is not None:
            thread.join(max(deadline - time.monotonic(), 0))
            return not thread.is_alive()
        return True

    @property
    def metrics_registry(self) -> Any:
        """This writer's ``prometheus_client.CollectorRegistry``."""
        return self._metrics.registry

    def durable_prefix(self, rollout_id: str) -> TurnPrefix | None:
        """The stored previous turn a put of ``rollout_id`` may continue (prefix
        omission): turn ``t − 1`` of the same base and segment, acknowledged by the store
        with a tokens hash, while no other put of ``rollout_id`` is in flight.  None
        otherwise (turn 0, not stored yet, forgotten, or a rr-v1-less format)."""
        if self.record_format != "rr-v1":
            return None
        rollout = parse_rollout_id(rollout_id)
        if rollout.turn == 0:
            return None
        with self._cond:
            if any(op.kind in ("put", "replay") and op.label == rollout_id
                   for op in self._ledger.ops.values()):
                return None
            return prefix_for(self._ledger.durable.get((rollout.base, rollout.segment)), rollout_id)

    def export_capture_metrics(self, stats: Callable[[], dict[str, Any]]) -> Any:
        """Export a capture manager's ``stats()`` with this writer's metrics (read at each
        scrape, labelled like the writer's); returns a handle for :meth:`remove_metrics`."""
        return self._metrics.add_source(stats, render_capture)

    def remove_metrics(self, handle: Any) -> None:
        """Stop exporting what :meth:`export_capture_metrics` added."""
        self._metrics.remove_source(handle)

    @property
    def worker_pid(self) -> int | None:
        """Pid of the current writer process (this process's pid in thread mode)."""
        return self._link.pid if self._link is not None else None

    @property
    def journal(self) -> Journal:
        return self._journal

    @property
    def dead_letters(self) -> DeadLetters:
        return self._dead

    # -- generations ---------------------------------------------------------------------
    def _settings(self, initial: bool) -> WorkerSettings:
        cfg = self.config
        sys_path = [p or os.getcwd() for p in sys.path]
        return WorkerSettings(
            store=config_to_dict(self._store_config),
            journal_dir=str(self._journal.directory), dead_letter_dir=str(self._dead.directory),
            retry_deadline_s=cfg.retry_deadline_s,
            retry_initial_backoff_s=cfg.retry_initial_backoff_s,
            retry_max_backoff_s=cfg.retry_max_backoff_s, only_last_turn=self.only_last_turn,
            clear_on_start=initial and cfg.clear_on_start, generation=self._generation,
            registrations=portable_store_registrations(), sys_path=sys_path,
            encoding=self.encoding, record_ttl_s=self.record_ttl_s)

    def _start_generation(self, initial: bool = False) -> bool:
        """Start a writer generation, re-sending what the last one left; False if closing."""
        with self._cond:
            if self._closing.is_set():
                return False
            self._generation += 1
            settings = self._settings(initial)
            if self.mode == "process":
                link: ProcessLink | ThreadLink = ProcessLink(
                    self._ring_memory.fd, self._ring_memory.capacity, self._dir_lock.fd)
                link.send(pack(["init", settings.to_dict()]))
            else:
                link = ThreadLink(self._thread_target(settings))
            for message in self._ledger.begin_restart():
                link.send(message)
            link.send(pack(["resync_done"]))
            self._started.clear()
            self._link = link
            self._link_started = time.monotonic()
        link.start()
        return True

    def _thread_target(self, settings: WorkerSettings) -> Any:
        ring = self._ring_memory.array

        def run(channel: Any) -> None:
            try:
                Worker(settings, channel, ring).run()
            except BaseException:  # noqa: BLE001 - the receiver restarts the worker
                log.exception("routing writer thread crashed; restarting it")

        return run

    def _receive_loop(self) -> None:
        restart_delay = 0.0
        while True:
            link = self._link
            try:
                messages = link.recv(_RECV_WAIT_S)
            except (EOFError, OSError):
                if self._closing.is_set():
                    self._link_exited.set()
                    return
                lived = time.monotonic() - self._link_started
                restart_delay = 0.0 if lived > 10 else min(max(restart_delay * 2, 0.1),
                                                           _MAX_RESTART_DELAY_S)
                with self._cond:
                    unacked = len(self._ledger.in_order(SENT))
                log.error("routing writer %s (pid %s) died; restarting it and re-sending %d "
                          "unacknowledged operations", self.mode, link.pid, unacked)
                link.close()
                self._metrics.inc("restarts")
                if (restart_delay and self._closing.wait(restart_delay)) or \
                        not self._start_generation():
                    self._link_exited.set()
                    return
                continue
            for start in range(0, len(messages), _RESULTS_PER_LOCK):
                if start:
                    time.sleep(0)  # let a submitting thread have the GIL between chunks
                with self._cond:
                    for data in messages[start:start + _RESULTS_PER_LOCK]:
                        if self._ledger.apply(unpack(data)):
                            self._started.set()
                    self._cond.notify_all()
                self._ledger.publish(self._metrics)  # only this thread applies results


@atexit.register
def _close_writers_at_exit() -> None:
    """Flush and close every writer still open when the interpreter exits."""
    for writer in list(_live_writers):
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - keep closing the others
            log.exception("routing writer: close at exit failed")
